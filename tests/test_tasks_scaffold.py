"""Scaffolds: prefix + middle + suffix == solution exactly (built-in suite, DICE's infilling file and
generated sources); the fast cut is at the cuda_source string, the load_inline cut is DICE's own;
body granularity cuts one __global__ kernel's body (tree-sitter), checked against hand-written
sources, a lexical brace matcher and generated comments / strings with braces; `dice-ray scaffold`."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dice_ray.cli import main
from dice_ray.tasks.loaders import load_tasks
from dice_ray.tasks.scaffold import (
    ScaffoldError,
    _literal_chars,
    detect_format,
    kernel_scaffolds,
    make_scaffold,
)

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


# ---- body granularity ---------------------------------------------------------------------------------

_LEX = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|[{}]', re.DOTALL)


def _lexical_close(text: str, open_at: int) -> int:
    """Index of the "}" matching the "{" at ``open_at``, skipping comments, strings and chars (an oracle
    independent of tree-sitter, for sources without preprocessor tricks)."""
    depth = 0
    for m in _LEX.finditer(text, open_at):
        if m.group() == "{":
            depth += 1
        elif m.group() == "}":
            depth -= 1
            if depth == 0:
                return m.start()
    raise AssertionError("unbalanced braces")


def _check_body_cut(src: str, name: str, sc) -> None:
    assert sc.prefix + sc.middle + sc.suffix == src
    assert sc.prefix.endswith("{") and sc.suffix.startswith("}")
    assert _lexical_close(src, len(sc.prefix) - 1) == len(sc.prefix) + len(sc.middle)
    signature = sc.prefix[sc.prefix.rfind("__global__"):]
    assert re.search(rf"\b{re.escape(name)}\s*\(", signature) and ";" not in signature.split("(")[0]


@given(st.sampled_from(BUILTIN))
@settings(max_examples=len(BUILTIN), deadline=None)
def test_builtin_body_cuts(task):
    cuts = kernel_scaffolds(task.solution_src, "fast")
    assert cuts
    for name, sc in cuts:
        _check_body_cut(task.solution_src, name, sc)
    assert make_scaffold(task.solution_src, "fast", "body") == cuts[0][1]
    assert make_scaffold(task.solution_src, "fast", "body", kernel=cuts[-1][0]) in [sc for _, sc in cuts]


def test_dice_infilling_file_body_cuts(dice_data):
    records = json.loads((dice_data / "kernel_infilling_evaluation.json").read_text())
    n_kernels = n_without = 0
    for rec in records:
        src = rec["cuda_code"]
        assert make_scaffold(src, "load_inline", "source").source == src
        try:
            cuts = kernel_scaffolds(src, "load_inline")
        except ScaffoldError as e:  # a few solutions only call cuBLAS / cuDNN from host code
            assert "no __global__ kernel" in str(e), rec["id"]
            n_without += 1
            continue
        for name, sc in cuts:
            _check_body_cut(src, name, sc)
            # the kernel lies inside DICE's middle (the CUDA source assignment)
            assert len(rec["prefix"]) < len(sc.prefix) and len(sc.prefix + sc.middle) < len(src) - len(rec["suffix"])
        n_kernels += len(cuts)
    assert n_kernels >= 90 and n_without <= 5


def _wrap(fmt: str, cuda: str):
    """A solution holding ``cuda``, and the map from CUDA text to its text in the Python source."""
    if fmt == "fast":
        return f'from dice_ray.launch import load_cuda\n\ncuda_source = r"""\n{cuda}"""\nkernels = load_cuda(cuda_source)\n', str

    def esc(t: str) -> str:  # a plain, non-raw literal
        return t.replace("\\", "\\\\")

    src = ("import torch\nfrom torch.utils.cpp_extension import load_inline\n\nsource = \"\"\"\n" + esc(cuda)
           + '"""\ncpp_src = "torch::Tensor f(torch::Tensor x);"\n'
           + "mod = load_inline(name='m', cpp_sources=cpp_src, cuda_sources=source, functions=['f'])\n")
    return src, esc


_HELPER = "__device__ float helper(float v) { return v > 0.f ? v : 0.f; }  // { not a kernel\n"
_CASES = {
    "nested": ("__global__ void k(float* x, int n) {",
               "\n  int i = threadIdx.x;\n  if (i < n) { for (int j = 0; j < 2; ++j) { x[i] += j; } }\n  { int t = 0; (void)t; }\n",
               "}\n"),
    "literals": ("extern \"C\" __global__ void k(char* out) {",
                 ("\n  // a } in a line comment {\n  /* { } }} */\n  const char* s = \"}{\\\"}\";\n"
                 "  char c = '}'; char d = '{'; char q = '\\''; out[0] = s[0] + c + d + q;\n"),
                 "}\n"),
    "template": ("template <typename T, int N = 4>\n__global__ void k(T* x) {",
                 "\n  T acc = T(0);\n  for (int i = 0; i < N; ++i) { acc += x[i]; }\n  x[0] = acc;\n",
                 "}\ntemplate __global__ void k<float, 4>(float*);\n"),
    "macros": (("#define BLOCK 256\n#define KLOOP(i, n) for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < (n); "
               "i += blockDim.x * gridDim.x)\n#define FAKE __global__ void fake(float* x) { x[0] = 0; }\n"
               "#ifdef USE_K\n__global__ void k(float* x, int n) {"),
               "\n  #pragma unroll\n  KLOOP(i, n) { x[i] = BLOCK; }\n",
               "}\n#endif\n"),
    "device-helper": (_HELPER + "__global__ void k(float* x) {", "\n  x[0] = helper(x[0]);\n", "}\n" + _HELPER),
    "launch-bounds": ("__global__ void __launch_bounds__(256, 2) k(float* x) {", " x[0] = 1.f; ",
                      "}\n__global__ __launch_bounds__(128) void k2(float* x) { x[0] = 2.f; }\n"),
    "extern-c-block": ("extern \"C\" {\n" + _HELPER + "__global__ void k(float* x) {", "\n  x[0] = helper(1.f);\n",
                       "}\n__global__ void k2(float* x) { x[0] = 2.f; }\n}  // extern \"C\"\n"),
    "non-ascii": ("// é ß 漢字 😀 {\n__global__ void k(float* x) {", "\n  x[0] = 1.f;  // ünïcode } 😀\n", "}\n"),
}


@pytest.mark.parametrize("fmt", ["fast", "load_inline"])
@pytest.mark.parametrize("case", sorted(_CASES))
def test_body_cut_hand_written(case, fmt):
    before, body, after = _CASES[case]
    src, esc = _wrap(fmt, "#include <cuda_runtime.h>\n" + before + body + after)
    sc = make_scaffold(src, fmt, "body")
    assert sc.source == src
    assert sc.middle == esc(body)
    assert sc.prefix.endswith(esc(before)) and sc.suffix.startswith(esc(after))
    assert make_scaffold(src, fmt, "body", kernel="k") == sc
    names = [n for n, _ in kernel_scaffolds(src, fmt)]
    assert names[0] == "k" and not {"helper", "fake", "KLOOP"} & set(names)


@pytest.mark.parametrize("fmt", ["fast", "load_inline"])
def test_several_kernels_in_turn(fmt):
    cuda = ("__global__ void first(float* x) { x[0] = 1.f; }\n" + _HELPER
            + "extern \"C\" __global__ void second(float* x) {\n  if (x) { x[1] = 2.f; }\n}\n"
            + "template <int N> __global__ void third(float* x) {}\n")
    src, _ = _wrap(fmt, cuda)
    cuts = kernel_scaffolds(src, fmt)
    assert [n for n, _ in cuts] == ["first", "second", "third"]
    assert [sc.middle for _, sc in cuts] == [" x[0] = 1.f; ", "\n  if (x) { x[1] = 2.f; }\n", ""]
    assert make_scaffold(src, fmt, "body", kernel="second") == cuts[1][1]
    assert make_scaffold(src, fmt, "body") == cuts[0][1]
    assert all(sc.source == src for _, sc in cuts)


def test_body_cut_maps_python_escapes_back_exactly():
    # a plain (non-raw) literal: \\n in a C string, \" , \t, \x41, \N{...}, a line continuation, CRLF newlines
    text = ("__global__ void k(char* o) {\\\r\n  printf(\"{\\\\n\");\t// \\N{LATIN SMALL LETTER E WITH ACUTE} }\r\n"
            "  o[0] = '\\x41'; o[1] = '\\u00e9' == 0; o[2] = '\\'';\r\n}\r\n")
    src = ("from torch.utils.cpp_extension import load_inline\r\nsrc = \"\"\"" + text + "\"\"\"\r\n"
           "m = load_inline(name='m', cpp_sources='', cuda_sources=[src])\r\n")
    sc = make_scaffold(src, "load_inline", "body")
    assert sc.source == src
    assert sc.prefix.endswith("__global__ void k(char* o) {")
    assert sc.middle.startswith("\\\r\n  printf(") and sc.middle.endswith("o[2] = '\\'';\r\n")
    assert sc.suffix.startswith("}\r\n\"\"\"")


def test_body_cut_of_a_single_quoted_literal_with_escaped_newlines():
    src = ("from torch.utils.cpp_extension import load_inline\n"
           "m = load_inline('m', '', '__global__ void k(int* x) {\\n  x[0] = 1;\\n}\\n', functions=['f'])\n")
    sc = make_scaffold(src, "load_inline", "body")
    assert sc.middle == "\\n  x[0] = 1;\\n" and sc.source == src


_tokens = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=60)


@given(value=_tokens, quote=st.sampled_from(["'", '"', "'''", '"""']), raw_newlines=st.booleans())
@example(value="a\\\nb\r\nc\N{SNOWMAN}\x00\U0001F600", quote='"""', raw_newlines=True)
@settings(max_examples=150, deadline=None)
def test_literal_chars_decodes_like_python(value, quote, raw_newlines):
    body = repr(value)[1:-1]
    if repr(value)[0] != quote[0]:  # repr chose the other quote: escape ours, unescape the other
        body = body.replace(quote[0], "\\" + quote[0]).replace("\\" + repr(value)[0], repr(value)[0])
    if raw_newlines and len(quote) == 3:
        body = body.replace("\\n", "\n").replace("\\\n", "\\\\n")  # real newlines in a triple-quoted string
    token = quote + body + quote
    decoded, spans = _literal_chars(token)
    assert decoded == eval(token)  # a literal built here
    assert len(spans) == len(decoded) and all(a < b for a, b in spans)
    assert all(spans[i][1] <= spans[i + 1][0] for i in range(len(spans) - 1))


# comments, string and char literals holding braces, inserted between a kernel's statements
_plain = st.text(alphabet=st.sampled_from("{}{}(); xyz=*/é漢😀") | st.characters(
    blacklist_categories=("Cs", "Cc", "Zl", "Zp"), blacklist_characters='"\\\'\x85'), max_size=12)
_fragment = st.one_of(
    _plain.map(lambda t: f"  // {t}\n"),
    _plain.filter(lambda t: "*/" not in t and not t.endswith("*")).map(lambda t: f"  /* {t} */\n"),
    _plain.map(lambda t: f'  s = "{t}";\n'),
    st.sampled_from(["{", "}", "\\'", '"', "\\\\"]).map(lambda c: f"  c = '{c}';\n"),
    st.sampled_from(['  s = "\\"}\\"{";\n', "  if (c) { x[0] = 1; }\n", "  { /* } */ }\n", "  #pragma unroll\n"]),
)
_escapers = {
    "backslashes": lambda t: t.replace("\\", "\\\\"),
    "newlines": lambda t: t.replace("\\", "\\\\").replace("\n", "\\n"),
    "non-ascii": lambda t: "".join(c if ord(c) < 128 else f"\\U{ord(c):08x}" for c in t.replace("\\", "\\\\")),
}


@given(frags=st.lists(_fragment, max_size=8), fmt=st.sampled_from(["fast", "load_inline"]),
       escaper=st.sampled_from(sorted(_escapers)))
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_body_cut_with_generated_braces_in_comments_and_strings(frags, fmt, escaper):
    body = "\n  const char* s; char c;\n" + "".join(frags)
    cuda = (_HELPER + 'extern "C" __global__ void k(float* x) {' + body + "}\n"
            + "__global__ void k2(float* x) { /* } */ x[0] = '}'; }\n")
    if fmt == "fast":
        src, esc = _wrap("fast", cuda)
    else:
        esc = _escapers[escaper]
        src = ("from torch.utils.cpp_extension import load_inline\ncuda = \"\"\"" + esc(cuda) + "\"\"\"\n"
               "m = load_inline(name='m', cpp_sources='', cuda_sources=cuda)\n")
    cuts = kernel_scaffolds(src, fmt)
    assert [n for n, _ in cuts] == ["k", "k2"]
    assert cuts[0][1].middle == esc(body) and cuts[1][1].middle == esc(" /* } */ x[0] = '}'; ")
    assert all(sc.source == src for _, sc in cuts)


@pytest.mark.parametrize(
    "src, kwargs, match",
    [
        ("x = 1\n", {}, "no load_cuda"),
        ('s = r"""__device__ void h() {}"""\nk = load_cuda(s)\n', {}, "no __global__ kernel"),
        ('s = r"""__global__ void k(float* x);"""\nk = load_cuda(s)\n', {}, "no __global__ kernel"),
        ('s = r"""// __global__ void k() {}\nint a;"""\nk = load_cuda(s)\n', {}, "no __global__ kernel"),
        ('s = r"""__global__ void a() {}\n__global__ void b() {}"""\nk = load_cuda(s)\n', {"kernel": "c"},
         r"no __global__ kernel named 'c'; kernels found: \['a', 'b'\]"),
        ('s = r"""__global__ void a() {}"""\nk = load_cuda(s)\n', {"kernel": "a", "granularity": "source"},
         "applies to granularity 'body' only"),
        ('s = r"""__global__ void a() {}"""\nk = load_cuda(s)\n', {"granularity": "kernel"}, "granularity must be"),
        ('s = r"""__global__ void a() {"""\nk = load_cuda(s)\n', {}, "does not parse as a"),
    ],
)
def test_body_scaffold_errors(src, kwargs, match):
    kwargs = {"granularity": "body", **kwargs}
    with pytest.raises(ScaffoldError, match=match):
        make_scaffold(src, "fast", **kwargs)


def test_body_needs_one_literal():
    src = "from torch.utils.cpp_extension import load_inline\nm = load_inline('m', '', '__global__ void k() {' '}')\n"
    assert make_scaffold(src, "load_inline").source == src  # the source cut still works
    with pytest.raises(ScaffoldError, match="one string literal"):
        make_scaffold(src, "load_inline", "body")


def test_detect_format():
    assert detect_format(BUILTIN[0].solution_src) == "fast"
    assert detect_format("from torch.utils.cpp_extension import load_inline\nm = load_inline('m', '', 'x')\n") == "load_inline"
    with pytest.raises(ScaffoldError, match="neither load_cuda"):
        detect_format("x = 1\n")


# ---- dice-ray scaffold ----------------------------------------------------------------------------------


def _solution_file(tmp_path, cuda: str, fmt: str = "load_inline"):
    path = tmp_path / "sol.py"
    path.write_text(_wrap(fmt, cuda)[0], encoding="utf-8")
    return path


@pytest.mark.parametrize("fmt", ["fast", "load_inline"])
def test_cli_scaffold_json(tmp_path, capsys, fmt):
    path = _solution_file(tmp_path, _HELPER + "__global__ void a(float* x) { x[0] = 1; }\n"
                          "__global__ void b(float* x) {\n  x[0] = 'é';\n}\n", fmt)
    src = path.read_text(encoding="utf-8")
    assert main(["scaffold", str(path), "--granularity", "body", "--kernel", "b", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["middle"] == "\n  x[0] = 'é';\n" and out["prefix"] + out["middle"] + out["suffix"] == src
    assert main(["scaffold", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    sc = make_scaffold(src, fmt)
    assert (out["prefix"], out["middle"], out["suffix"]) == (sc.prefix, sc.middle, sc.suffix)


def test_cli_scaffold_readable(tmp_path, capsys):
    path = _solution_file(tmp_path, "__global__ void a(float* x) { x[0] = 1; }\n")
    assert main(["scaffold", str(path), "--granularity", "body"]) == 0
    out = capsys.readouterr().out
    assert "----- middle (11 chars; load_inline format, body granularity) -----\n x[0] = 1; \n" in out
    assert out.index("----- prefix") < out.index("----- middle") < out.index("----- suffix")


@pytest.mark.parametrize(
    "content, args, match",
    [
        ("__device__ float h() { return 0; }\n", ["--granularity", "body"], "no __global__ kernel"),
        ("__global__ void a() {}\n", ["--granularity", "body", "--kernel", "zz"], r"kernels found: \['a'\]"),
        (None, [], "no such file"),
        ("", [], "the file is empty"),
    ],
)
def test_cli_scaffold_errors(tmp_path, capsys, content, args, match):
    if content is None:
        path = tmp_path / "missing.py"
    elif content:
        path = _solution_file(tmp_path, content)
    else:
        path = tmp_path / "empty.py"
        path.write_text("\n")
    assert main(["scaffold", str(path), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dice-ray: ") and err.count("\n") == 1 and re.search(match, err)


def test_cli_scaffold_file_without_loader(tmp_path, capsys):
    path = tmp_path / "plain.py"
    path.write_text("import torch\n")
    assert main(["scaffold", str(path)]) == 2
    assert "neither load_cuda" in capsys.readouterr().err
