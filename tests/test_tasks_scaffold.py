"""Scaffolds: prefix + middle + suffix == solution exactly (built-in suite, DICE's infilling file and
generated sources); the fast cut is at the cuda_source string, the load_inline cut is DICE's own."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dice_ray.tasks.loaders import load_tasks
from dice_ray.tasks.scaffold import ScaffoldError, make_scaffold

BUILTIN = load_tasks("builtin").tasks


@given(st.sampled_from(BUILTIN))
@settings(max_examples=len(BUILTIN), deadline=None)
def test_builtin_invariant_and_fast_cut(task):
    sc = make_scaffold(task.solution_src, "fast")
    assert sc.prefix + sc.middle + sc.suffix == task.solution_src == sc.source
    assert sc.prefix.endswith('cuda_source = r"""\n')
    assert sc.suffix.startswith('"""\n')
    assert '"""' not in sc.middle and 'extern "C" __global__' in sc.middle


def test_dice_infilling_file_matches_dice_split(dice_data):
    records = json.loads((dice_data / "kernel_infilling_evaluation.json").read_text())
    assert len(records) >= 90
    for rec in records:
        sc = make_scaffold(rec["cuda_code"], "load_inline")
        assert sc.source == rec["cuda_code"]
        assert (sc.prefix, sc.middle, sc.suffix) == (rec["prefix"], rec["middle"], rec["suffix"]), rec["id"]


# ---- generated sources: any variable name, any surrounding code, any CUDA text ----------------------

_ident = st.from_regex(r"[a-z][a-z0-9_]{0,12}", fullmatch=True).filter(
    lambda s: s not in {"if", "in", "is", "or", "and", "not", "for", "def", "del", "try", "as", "with", "else",
                        "elif", "from", "class", "while", "pass", "raise", "yield", "import", "return", "lambda",
                        "global", "assert", "async", "await", "break", "except", "finally", "continue", "nonlocal",
                        "cpp_src", "mod", "kernels", "torch", "load_inline", "load_cuda"}
)
# CUDA-ish text: any printable characters (non-ASCII too) and newlines, but no quotes or backslashes
# that would end or escape the Python string literal
_cuda_text = st.text(
    alphabet=st.sampled_from("\n\n\n\t {}();=*+<>#/'xyz019") | st.characters(
        blacklist_categories=("Cs", "Cc"), blacklist_characters='"\\'
    ),
    max_size=300,
)
_comment = st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc")), max_size=40).map(
    lambda s: "# " + s.replace("\r", " ").replace("\n", " ").replace("\u2028", " ").replace("\u2029", " ")
    .replace("\x85", " ").replace("\x0b", " ").replace("\x0c", " ") + "\n"
)


@given(var=_ident, body=_cuda_text, before=_comment, after=_comment, raw=st.booleans(), newline=st.booleans())
@example(var="src", body="\nx", before="# \n", after="# \n", raw=True, newline=False)
@example(var="src", body="", before="# \n", after="# \n", raw=False, newline=True)
@example(var="src", body="é\n//ü", before="# ß\n", after="# \n", raw=True, newline=True)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_fast_invariant_generated(var, body, before, after, raw, newline):
    opening = ('r"""' if raw else '"""') + ("\n" if newline else "")
    src = (
        "import torch\nfrom dice_ray.launch import load_cuda\n" + before + f"{var} = {opening}{body}\"\"\"\n" + after
        + f"kernels = load_cuda({var})\n\n\nclass ModelNew:\n    pass\n"
    )
    sc = make_scaffold(src, "fast")
    assert sc.source == src
    # one newline right after the opening quotes belongs to the prefix (the `cuda_source = r"""` line)
    moved = not newline and body.startswith("\n")
    assert sc.middle == (body[1:] if moved else body)
    assert sc.prefix.endswith(opening + ("\n" if moved else ""))


@given(var=_ident, body=_cuda_text, before=_comment, after=_comment, listed=st.booleans(), kw=st.booleans())
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_load_inline_invariant_generated(var, body, before, after, listed, kw):
    arg = f"[{var}]" if listed else var
    call = f"name='m', cpp_sources=cpp_src, cuda_sources={arg}" if kw else f"'m', cpp_src, {arg}"
    assignment = f'{var} = """{body}"""'
    src = (
        "import torch\nfrom torch.utils.cpp_extension import load_inline\n" + before + assignment + "\n\n"
        + 'cpp_src = "torch::Tensor f(torch::Tensor x);"\n' + after + f"mod = load_inline({call}, functions=['f'])\n"
    )
    sc = make_scaffold(src, "load_inline")
    assert sc.source == src
    assert sc.middle == assignment
    assert sc.suffix.startswith("\n\ncpp_src")


def test_load_inline_uses_the_last_assignment_before_the_call():
    src = (
        's = """old"""\nfrom torch.utils.cpp_extension import load_inline\ns = """new"""\n'
        "m = load_inline(name='m', cpp_sources='', cuda_sources=s)\ns = \"\"\"later\"\"\"\n"
    )
    sc = make_scaffold(src, "load_inline")
    assert sc.middle == 's = """new"""' and sc.source == src


def test_literal_passed_directly():
    src = 'from dice_ray.launch import load_cuda\nkernels = load_cuda(r"""\nextern "C" __global__ void k() {}\n""")\n'
    sc = make_scaffold(src, "fast")
    assert sc.middle == 'extern "C" __global__ void k() {}\n' and sc.source == src


@pytest.mark.parametrize(
    "src, fmt, match",
    [
        ("x = 1\n", "fast", "no load_cuda"),
        ("def f(:\n", "fast", "does not parse"),
        ("k = load_cuda(a + b)\n", "fast", "BinOp"),
        ("k = load_cuda(src)\n", "fast", "never assigned"),
        ("src = make()\nk = load_cuda(src)\n", "fast", "not a string literal"),
        ("src = 'single line'\nk = load_cuda(src)\n", "fast", "triple-quoted"),
        ('src = """a""" """b"""\nk = load_cuda(src)\n', "fast", "triple-quoted"),
        ("m = load_inline(name='m', cpp_sources='')\n", "load_inline", "no load_inline"),
        ("m = load_inline(name='m', cpp_sources='', cuda_sources=[a, b])\n", "load_inline", "2 items"),
        ("x = 1\n", "triton", "fmt must be"),
    ],
)
def test_scaffold_errors(src, fmt, match):
    with pytest.raises(ScaffoldError, match=match):
        make_scaffold(src, fmt)
