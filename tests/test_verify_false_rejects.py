"""Honest code the static rules once refused (tests/corpus/honest/PENDING.md's kinds), accepted now, and the cheats
next to each that stay refused.

Each kind: what public KernelBench solutions write (accepted), then the near misses (refused, by the rule named).
The honest corpus (tests/corpus/honest/, test_honest_corpus.py) holds a whole solution of each kind.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from _verify_sources import HONEST, RELU_REF, mutate
from dice_ray.verify.candidate.candidate import Candidate
from dice_ray.verify.candidate.inline_spec import UnsupportedFormat, extract_specs
from dice_ray.verify.candidate.liveness import construction_code, dead_code
from dice_ray.verify.rules.allowlist import import_allowed
from dice_ray.verify.rules.check import check_candidate

FWD = "        return y\n"
INIT = "        super().__init__()\n"
INLINE = (Path(__file__).resolve().parent / "corpus" / "honest" / "linear_relu_init_helper.py").read_text()


def in_forward(code: str, src: str = HONEST) -> str:
    """``src`` with ``code`` (indented 8) before forward's ``return y``."""
    return mutate(FWD, "".join(f"        {ln}\n" for ln in code.splitlines()) + FWD, src)


def in_init(code: str, src: str = HONEST) -> str:
    """``src`` with ``code`` (indented 8) after ``super().__init__()``."""
    return mutate(INIT, INIT + "".join(f"        {ln}\n" for ln in code.splitlines()), src)


def with_methods(methods: str, src: str = HONEST) -> str:
    """``src`` with ``methods`` (indented 4) before forward."""
    return mutate("    def forward(self, x):", "".join(f"    {ln}\n" if ln else "\n" for ln in methods.splitlines())
                  + "\n    def forward(self, x):", src)


def at_top(code: str, src: str = HONEST) -> str:
    return mutate("import torch\n", f"import torch\n{code}\n", src)


def ok(src: str) -> None:
    report = check_candidate(src)
    assert report.ok, [str(v) for v in report.violations]


def refused(src: str, rule: str, *words: str) -> str:
    """The first violation of ``rule`` whose message holds ``words`` (asserting there is one)."""
    found = [str(v) for v in check_candidate(src).violations]
    hits = [v for v in found if v.startswith(f"[{rule}]") and all(w in v for w in words)]
    assert hits, f"expected {rule} with {words}, got {found}"
    return hits[0]


# -- 1. construction code: what only __init__ reaches -----------------------------------------------------------
RESET = """def reset_parameters(self):
    nn.init.kaiming_uniform_(self.w, a=5 ** 0.5)
    with torch.no_grad():
        self.w.copy_(torch.randn(4, 4))
"""


def test_a_method_only_init_calls_is_construction_code():
    """nn.Conv2d's reset_parameters() pattern, a chain of init-only methods, a _make_layer() builder, a decorated
    one, a nested def, a module-level helper and a helper class built in __init__: judged as __init__ is."""
    ok(in_init("self.w = nn.Parameter(torch.empty(4, 4))\nself.reset_parameters()", with_methods(RESET)))
    chain = with_methods("@torch.no_grad()\ndef reset_parameters(self):\n    self._weights()\n\n"
                         "def _weights(self):\n    nn.init.xavier_uniform_(self.w)\n    self.w.mul_(2)\n\n"
                         "def _make_layer(self, n):\n    return nn.Sequential(*(nn.Conv2d(n, n, 3) for _ in range(2)))\n")
    ok(in_init("self.w = nn.Parameter(torch.empty(4, 4))\nself.reset_parameters()\nself.layer = self._make_layer(4)",
               chain))
    nested = in_init("def fill(t):\n    nn.init.normal_(t)\n    return t\nself.w = nn.Parameter(fill(torch.empty(4)))")
    ok(nested)
    helper = mutate("class ModelNew", "def make_weight(n):\n    return nn.Parameter(torch.randn(n, n).relu())\n\n\n"
                    "class Block(nn.Module):\n    def __init__(self, n):\n        super().__init__()\n"
                    "        self.w = nn.Parameter(torch.empty(n))\n        self.reset()\n\n"
                    "    def reset(self):\n        nn.init.ones_(self.w)\n\n\nclass ModelNew",
                    in_init("self.w = make_weight(4)\nself.blocks = nn.ModuleList(Block(4) for _ in range(2))"))
    ok(helper)


def test_a_method_run_time_code_reaches_stays_run_time_code():
    """Called from forward too, handed to a hook (a value), called in a lambda or a kept generator, named in a string
    (getattr), a generator, a name nn.Module has, reached from __call__: judged as run-time code."""
    base = with_methods(RESET)
    both = in_forward("self.reset_parameters()", in_init("self.w = nn.Parameter(torch.empty(4, 4))\n"
                                                         "self.reset_parameters()", base))
    msg = refused(both, "forward-torch-op", "kaiming_uniform_", "also called from forward")
    assert "only what __init__ alone calls is construction code" in msg
    hooked = in_init("self.w = nn.Parameter(torch.empty(4, 4))\nself.reset_parameters()\n"
                     "self.register_forward_pre_hook(self.reset_parameters)", base)
    refused(hooked, "forward-torch-op", "kaiming_uniform_", "other than by a call")
    lam = in_init("self.w = nn.Parameter(torch.empty(4, 4))\nself.reset_parameters()\n"
                  "self.h = self.register_forward_hook(lambda m, i, o: self.reset_parameters())", base)
    refused(lam, "forward-torch-op", "in a lambda")
    kept = in_init("self.w = nn.Parameter(torch.empty(4, 4))\nself.g = (self.reset_parameters() for _ in range(9))", base)
    refused(kept, "forward-torch-op", "kaiming_uniform_")
    named = in_forward("h = hasattr(self, 'reset_parameters')", in_init("self.w = nn.Parameter(torch.empty(4, 4))\n"
                                                                          "self.reset_parameters()", base))
    refused(named, "forward-torch-op", "kaiming_uniform_")
    gen = with_methods("def weights(self):\n    yield torch.randn(4).relu()\n",
                       in_init("self.g = self.weights()", in_forward("w = next(iter([1]))")))
    refused(gen, "forward-torch-op", "torch.randn")
    reserved = with_methods("def extra_repr(self):\n    return str(torch.ones(1).sum())\n",
                            in_init("s = self.extra_repr()"))
    refused(reserved, "forward-torch-op")
    dunder_call = mutate("class ModelNew", "class Filler:\n    def __init__(self):\n        self.fill()\n\n"
                         "    def fill(self):\n        return torch.randn(3).relu()\n\n"
                         "    def __call__(self):\n        return self.fill()\n\n\nclass ModelNew", in_init("self.f = Filler()"))
    refused(dunder_call, "forward-torch-op", "torch.randn", "also called from __call__")


def test_a_class_run_time_code_builds_runs_its_init_at_run_time():
    """Helper(x) in forward: its __init__ (and what only it calls) is run-time code, its stores on self fill a new
    object (tests/corpus/cheats/lazy_output.py's shape stays free of static rules)."""
    helper = "class H:\n    def __init__(self, t):\n        self.t = t\n        self.y = torch.relu(t)\n\n\nclass ModelNew"
    src = mutate("class ModelNew", helper, in_forward("y = H(y).y"))
    msg = refused(src, "forward-torch-op", "torch.relu", "this __init__ runs at run time", "H is used from forward")
    assert "forward-state" not in {v.rule for v in check_candidate(src).violations}
    built_once = mutate("class ModelNew", helper, in_init("self.h = H(torch.ones(2))"))
    ok(built_once)
    sub = mutate("class ModelNew", helper.replace("class ModelNew", "class G(H):\n    pass\n\n\nclass ModelNew"),
                 in_forward("g = G(y)"))
    refused(sub, "forward-torch-op", "torch.relu", "H is a base of G")
    assert msg


def test_construction_code_sets():
    tree = ast.parse(with_methods("def a(self):\n    self.b()\n\ndef b(self):\n    return 1\n\ndef c(self):\n    return 2\n",
                                  in_init("self.a()", in_forward("n = self.c()"))))
    cons = construction_code(tree, dead_code(tree), frozenset({"forward"}))
    named = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert {id(named[k]) for k in ("__init__", "a", "b")} <= cons.functions
    assert id(named["c"]) not in cons.functions and id(named["forward"]) not in cons.functions


# -- 2. casts: .float() is .to(torch.float32); a cast to the task's own dtype is left to run time --------------------
def test_float_cast_is_to_float32():
    ok(in_forward("z = y.float()\nz = y.to(torch.float32)\nz = y.to(dtype=torch.float32)\nz = y.to(y.device)"))
    for code, dtype in (("z = y.half()", "float16"), ("z = y.to(torch.float16)", "float16"),
                        ("z = y.bfloat16()", "bfloat16"), ("z = y.to(dtype=torch.bfloat16)", "bfloat16"),
                        ("z = y.long()", "int64"), ("z = y.to(torch.int64)", "int64"),
                        ("z = y.type(torch.cuda.HalfTensor)", "float16"), ("z = y.to('cuda', torch.half)", "float16")):
        refused(in_forward(code), "forward-torch-op", f"torch.{dtype}", "float32 assumed")
    refused(in_forward("z = self.float()"), "forward-module-call")  # a module cast converts every parameter
    refused(in_forward("z = self.double()"), "forward-module-call")
    refused(in_forward("f = y.float"), "forward-torch-op", "as a value")
    refused(in_forward("z = y.float().sum()"), "forward-torch-op", ".sum()")


REF_F64 = (Path(__file__).resolve().parent / "corpus" / "honest" / "references" / "softsign_float64.py").read_text()
REF_F16 = REF_F64.replace("torch.float64", "torch.float16")
REF_INDEX = """import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, n, d):
        super().__init__()
        self.table = nn.Embedding(n, d)

    def forward(self, idx):
        return self.table(idx)


def get_inputs():
    return [torch.randint(0, 1000, (64, 32))]


def get_init_inputs():
    return [1000, 128]
"""


def test_input_dtypes_reads_the_references_inputs():
    from dice_ray.tasks.sizing import input_dtypes

    relu = (Path(__file__).resolve().parents[1] / "dice_ray" / "tasks" / "builtin" / "L1_01_relu" / "reference.py")
    assert input_dtypes(relu.read_text()) == {"float32"}
    assert input_dtypes(REF_F64) == {"float32", "float64"}
    assert input_dtypes(REF_F16) == {"float32", "float16"}
    assert input_dtypes(REF_INDEX) == {"float32", "int64"}
    body = "def get_inputs():\n    return [{}]\n"
    for inputs, dtypes in (("torch.randn(8).double()", {"float64"}), ("torch.randn(8).to(torch.half)", {"float16"}),
                           ("torch.rand(8) > 0.5", {"bool"}), ("torch.randn(8).ge(0)", {"bool"}),
                           ("torch.tensor([1, 2, 3])", {"int64"}), ("torch.tensor([True, False])", {"bool"}),
                           ("torch.tensor([i for i in range(4)])", {"int64"}), ("torch.arange(8)", {"int64"}),
                           ("torch.randn(8, dtype=DT)", {"bfloat16"}), ("torch.randn(8, dtype=torch.long)", {"int64"})):
        src = "import torch\n" + ("DT = torch.bfloat16\n" if "DT" in inputs else "") + "\n" + body.format(inputs)
        assert input_dtypes(src) == {"float32", *dtypes}, inputs
    # the model's own casts are not its inputs'; a source that does not parse: float32
    assert input_dtypes("import torch\nclass Model:\n    def f(self, x):\n        return x.half()\n") == {"float32"}
    assert input_dtypes("def (") == {"float32"}


def test_a_cast_to_the_tasks_own_dtype_is_left_to_run_time():
    """.double() / .to(torch.float64) on a float64 task's input, .half() on a float16 task's, .long() on int64 indices:
    no-op casts, left to the run-time op check (which refuses one that converts); casts to float64 never lower
    precision, so they are left to it whatever the task."""
    from dice_ray.tasks.sizing import input_dtypes

    f64, f16, idx = input_dtypes(REF_F64), input_dtypes(REF_F16), input_dtypes(REF_INDEX)
    wide = "z = y.double()\nz = y.to(torch.float64)\nz = y.to(dtype=torch.double)\nz = y.type(torch.DoubleTensor)"
    for dtypes in (None, f64, f16, frozenset({"float32"})):
        report = check_candidate(in_forward(wide), input_dtypes=dtypes)
        assert report.ok, [str(v) for v in report.violations]
    for code, dtypes in (("z = y.half()", f16), ("z = y.to(torch.float16)", f16), ("z = y.long()", idx),
                         ("z = y.to(torch.int64)", idx), ("z = y.to(y.device, torch.half)", f16)):
        report = check_candidate(in_forward(code), input_dtypes=dtypes)
        assert report.ok, (code, [str(v) for v in report.violations])


@pytest.mark.parametrize("code,task,dtype", [
    ("z = y.half()", "f32", "float16"), ("z = y.half()", "f64", "float16"), ("z = y.bfloat16()", "f16", "bfloat16"),
    ("z = y.to(torch.bfloat16)", "f64", "bfloat16"), ("z = y.int()", "index", "int32"),
    ("z = y.long()", "f64", "int64"),
    ("z = y.bool()", "f32", "bool"),
])
def test_a_cast_to_a_dtype_no_input_has_stays_refused(code, task, dtype):
    from dice_ray.tasks.sizing import input_dtypes

    ref = {"f32": RELU_REF, "f64": REF_F64, "f16": REF_F16, "index": REF_INDEX}[task]
    found = [str(v) for v in check_candidate(in_forward(code), input_dtypes=input_dtypes(ref)).violations]
    assert any(v.startswith("[forward-torch-op]") and f"no input of the task is {dtype}" in v for v in found), found


def test_the_run_time_op_check_refuses_a_cast_that_converts():
    """A cast to the dtype its input has runs no aten op; one that converts is aten _to_copy, refused by the op
    recorder (on meta tensors too: the compile-only dry run), the conversion named for the message."""
    import torch

    from dice_ray.verify.trials.op_recorder import OpRecorder

    for device in ("cpu", "meta"):
        x64 = torch.randn(4, 4, dtype=torch.float64, device=device)
        with torch.no_grad(), OpRecorder() as noop:
            x64.double(), x64.to(torch.float64), x64.to(dtype=torch.float64), x64.type(torch.float64)
        assert noop.forbidden == [] and noop.casts == []
        with torch.no_grad(), OpRecorder() as real:
            x64.float().half()
        assert real.forbidden == ["_to_copy"]
        assert real.casts == ["torch.float64 -> torch.float32", "torch.float32 -> torch.float16"]


F64_CANDIDATE = mutate("float* __restrict__ x, float* __restrict__ y", "double* __restrict__ x, double* __restrict__ y",
                       mutate("x[i] > 0.f ? x[i] : 0.f", "x[i] > 0.0 ? x[i] : 0.0",
                              mutate("        x = x.contiguous()\n", "        x = x.double().contiguous()\n")))
REF_RELU_F64 = RELU_REF.replace("torch.randn(1024, 1024)", "torch.randn(1024, 1024, dtype=torch.float64)")


@pytest.fixture(scope="module")
def verifier():
    from dice_ray.config import RewardConfig, VerifyConfig
    from dice_ray.verify.verifier import Verifier

    with Verifier(VerifyConfig(mode="compile_only", compile_timeout_s=60.0, run_timeout_s=30.0), RewardConfig()) as v:
        yield v


def test_the_verifier_leaves_a_no_op_cast_alone_and_refuses_one_that_converts(verifier):
    """Compile-only: x.double() on a float64 task's input is ok; on a float32 task's input the dry run sees the
    conversion (the fast format's forward runs to its end on meta tensors); x.half() on a float32 task is refused by
    the static rules, which know the task's dtypes."""
    from dice_ray.tasks.task import Task

    f64, f32 = Task("test/relu64", "relu64", 1, REF_RELU_F64), Task("test/relu", "relu", 1, RELU_REF)
    got = verifier.verify(f64, F64_CANDIDATE, "double-cast")
    assert got.verdict == "ok", got.reason
    got = verifier.verify(f32, F64_CANDIDATE, "double-cast-converts")
    assert got.verdict == "cheat" and got.rule == "forward-torch-op", got.reason
    assert "torch.float32 -> torch.float64" in got.reason
    got = verifier.verify(f32, mutate("        x = x.contiguous()\n", "        x = x.half().contiguous()\n"), "half")
    assert got.verdict == "cheat" and got.rule == "forward-torch-op" and "no input of the task is float16" in got.reason
    got = verifier.verify(f64, mutate("x.double()", "x.half()", F64_CANDIDATE), "half-on-f64")
    assert got.verdict == "cheat" and got.rule == "forward-torch-op", got.reason


# -- 3. torch.Tensor() as an allocation ---------------------------------------------------------------------------
def test_empty_torch_tensor_is_an_allocation():
    ok(in_forward("b = torch.Tensor()\nb = torch.Tensor(0)\nb = torch.Tensor(y.size(0), 4)\nb = torch.Tensor(y.shape[0])"))
    refused(in_forward("b = torch.Tensor([1.0, 2.0])"), "forward-torch-op", "torch.tensor(data)")
    refused(in_forward("b = torch.Tensor(y)"), "forward-torch-op", "torch.Tensor")
    refused(in_forward("b = torch.Tensor(n)"), "forward-torch-op", "torch.Tensor")  # a name the rules cannot size
    refused(in_forward("b = torch.Tensor(2).add(1)"), "forward-torch-op", ".add()")


# -- 4. module constants unpacked from a tuple ----------------------------------------------------------------------
def test_tuple_unpacked_constants_are_constants():
    ok(at_top("D, H, W = 16, 32, 32\na, b = (1, 2)\n(c, d), e = (1, -2), 3 * 4\nM = 256 * 8\nLOW, HIGH = -1.5, 2 ** 3"))
    for code in ("a, b = torch.randn(2), 1", "a, *rest = 1, 2, 3", "a, b = [], {}", "a, b = divmod(7, 2)",
                 "a, b = c = 1, 2\nc.x = 3"):
        refused(at_top(code), "module-state") if "c.x" not in code else refused(at_top(code), "patching")
    # a name bound twice has no one value: a format template rebound by an unpacking is not a constant string
    tmpl = at_top("T = '{0}'\nT, U = '{0.__globals__}', 1", in_forward("s = T.format(y)"))
    refused(tmpl, "dynamic-code", "not a constant string")


def test_load_inline_reads_tuple_unpacked_and_arithmetic_constants():
    src = mutate('linear_relu_cpp = "', 'BLOCK, HALF = 16, 16 // 2\nNEG = -1.5\nCAP = 64 * 1024\n'
                 'linear_relu_cpp = f"// {BLOCK} {HALF} {NEG} {CAP}\\n" + "', INLINE)
    assert check_candidate(src).ok, [str(v) for v in check_candidate(src).violations]
    spec = extract_specs(src)[0]
    assert spec.cpp_sources[0].startswith("// 16 8 -1.5 65536\n")
    with pytest.raises(UnsupportedFormat):
        extract_specs(mutate("BLOCK, HALF = 16, 16 // 2", "BLOCK, HALF = divmod(32, 2)", src))


REF_TUPLE = """import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, dim):
        super().__init__()

    def forward(self, x):
        return torch.relu(x)


batch_size, dim = 1_048_576, 1024  # as 53 KernelBench level-2/3 references write their sizes


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return [dim]
"""


def test_a_reference_sizes_its_inputs_with_tuple_unpacked_constants():
    """A reference whose only size constant is tuple-unpacked is scaled (and shape-trialled), not refused; a name bound
    on its own line still comes first, and a name bound twice is no size constant."""
    from dice_ray.tasks.loaders import load_tasks
    from dice_ray.tasks.sizing import scale_down_inputs, shape_constant, static_input_elements

    assert shape_constant(REF_TUPLE) == ("batch_size", 2**20) and static_input_elements(REF_TUPLE) == 2**30
    assert scale_down_inputs(REF_TUPLE, 2**20) == REF_TUPLE.replace("1_048_576", "1024")
    single = REF_TUPLE.replace("batch_size, dim = 1_048_576, 1024", "height, width = 64, 64\nbatch_size = 16\ndim = 4")
    assert shape_constant(single.replace("randn(batch_size, dim)", "randn(batch_size, dim, height, width)")) == \
        ("batch_size", 16)
    assert shape_constant(REF_TUPLE.replace("\n\ndef get_inputs", "\nbatch_size = 8\n\ndef get_inputs")) is None
    import json
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "big.jsonl").write_text(json.dumps({"reference": REF_TUPLE, "id": 0}))
        report = load_tasks(f"jsonl:{Path(d) / 'big.jsonl'}")
    assert [t.task_id for t in report.tasks] == ["jsonl-big/0"] and report.scaled[0].constant == "batch_size"


# -- 5. imports: torch's helpers and the pure helpers the references import -----------------------------------------
def test_helper_imports_are_allowed():
    for module, names in (("torch.nn.modules.utils", ("_pair", "_triple")), ("torch.nn.init", ()), ("itertools", ()),
                          ("collections.abc", ()), ("collections", ("OrderedDict",)), ("numbers", ()),
                          ("torch.nn.parameter", ("Parameter",))):
        assert import_allowed(module, names), module
    ok(at_top("from torch.nn.modules.utils import _pair\nfrom itertools import repeat\nimport collections.abc\n"
              "import numbers\nimport torch.nn.init as init",
              in_forward("k = _pair(3)\nr = tuple(repeat(1, 2))\nq = isinstance(k, collections.abc.Iterable)\n"
                         "i = isinstance(n, numbers.Integral)",
                         in_init("self.w = nn.Parameter(torch.empty(4, 4))\ninit.kaiming_uniform_(self.w)"))))


@pytest.mark.parametrize("code,use,rule", [
    ("import os", "os.getpid()", "forbidden-import"),
    ("import functools", "functools.reduce(max, [1, 2])", "forbidden-import"),
    ("import operator", "operator.attrgetter('x')", "forbidden-import"),
    ("import numpy as np", "np.zeros(1)", "forbidden-import"),
    ("from einops import rearrange", "rearrange(y, 'a b -> b a')", "forbidden-import"),
    ("import torch.nn.init as init", "init.normal_(y)", "forward-torch-op"),  # judged by where it runs
    ("import torch.nn.init as init", "w = init.warnings", "forbidden-import"),  # no module behind it
    ("import collections", "s = collections._sys", "dynamic-code"),
    ("import itertools", "z = list(itertools.starmap(self.act, [(y,)]))", "forward-module-call"),
    ("import itertools", "z = list(itertools.accumulate([y, y], torch.add))", "forward-torch-op"),
    ("import collections", "d = collections.defaultdict(self.act)", "forward-module-call"),
])
def test_near_miss_imports_stay_refused(code, use, rule):
    refused(at_top(code, in_forward(use)), rule)


def test_a_counter_kept_on_self_is_state():
    """itertools.count() (or iter(range(...))) kept on self and advanced in forward counts calls."""
    src = at_top("import itertools", in_forward("k = next(self.calls)", in_init("self.calls = itertools.count()")))
    refused(src, "forward-state", "advances self.calls")
    refused(in_forward("k = next(self.it)", in_init("self.it = iter(range(10 ** 9))")), "forward-state")
    ok(in_forward("k = next(iter(y.shape))"))


# -- 6. getattr reading a parameter by name ---------------------------------------------------------------------------
WEIGHTS = "self.weight_a = nn.Parameter(torch.ones(4))\nself.weight_b = nn.Parameter(torch.ones(4))"


def test_getattr_reading_a_parameter_by_name():
    ok(in_forward("w = getattr(self, 'weight_a')\nv = getattr(self, 'weight_' + 'b').contiguous()\n"
                  "u = [getattr(self, 'weight_' + s) for s in ('a', 'b')]\nt = getattr(self, f'weight_{n % 2}')",
                  in_init(WEIGHTS)))


@pytest.mark.parametrize("use,rule", [
    ("f = getattr(torch, 'relu')", "dynamic-code"),
    ("f = getattr(y, 'sum')", "dynamic-code"),
    ("f = getattr(self, 'forward')", "dynamic-code"),
    ("f = getattr(self.act, 'forward')", "dynamic-code"),
    ("z = getattr(self, 'weight_a')(y)", "dynamic-code"),  # its value called
    ("f = getattr(self, 's' + 'um')", "dynamic-code"),  # a prefix torch's names begin with
    ("f = getattr(self, 're' + name)", "dynamic-code"),  # 'relu', 'reshape'...
    ("f = getattr(self, name)", "dynamic-code"),
    ("f = getattr(self, '_modules')", "dynamic-code"),
    ("f = getattr(self, 'weight_a', None)", "dynamic-code"),
    ("f = getattr(self, 'helper')", "dynamic-code"),  # a method of the candidate
    ("f = getattr(self, 'weight_a')\nz = f(y)", "forward-module-call"),
    ("getattr(self, 'weight_a').add_(1)", "forward-state"),
    ("s = getattr", "dynamic-code"),
])
def test_getattr_near_misses_stay_refused(use, rule):
    src = with_methods("def helper(self):\n    return 1\n", in_init(WEIGHTS, in_forward(use)))
    refused(src, rule)


def test_worker_getattr_reads_only_tensors_modules_and_plain_values():
    import torch

    from dice_ray.verify.trials.import_guard import candidate_builtins, read_attribute
    from dice_ray.verify.trials.outcome import RuleBroken

    lin = torch.nn.Linear(2, 2)
    assert read_attribute(lin, "weight") is lin.weight and read_attribute(lin, "in_features") == 2
    for name in ("forward", "_parameters", "__class__", "training_not_there"):
        with pytest.raises((RuleBroken, AttributeError)):
            read_attribute(lin, name)
    with pytest.raises(RuleBroken):
        read_attribute(torch, "nn")
    assert candidate_builtins(True)["getattr"] is read_attribute and "setattr" not in candidate_builtins(True)


# -- 7. load_inline inside __init__: self.ext = load_inline(...) with constant arguments ------------------------------
LOAD = INLINE[INLINE.index("fused = load_inline("):INLINE.index("class ModelNew")]
CALL_ARGS = LOAD.split("= ", 1)[1]


def init_load(src: str = INLINE, call: str = CALL_ARGS, before: str = "") -> str:
    """``src`` (linear_relu_init_helper.py) with its top-level ``fused = load_inline(...)`` moved into ``__init__`` as
    ``self.fused = <call>`` (``before``: lines of __init__ ahead of it), forward calling ``self.fused``."""
    src = mutate(LOAD, "", src)
    body = "".join(f"        {ln}\n" for ln in before.splitlines()) + "        self.fused = " + \
        call.replace("\n", "\n        ").rstrip() + "\n"
    return mutate("fused.linear_relu", "self.fused.linear_relu", mutate(INIT, INIT + body, src))


def test_load_inline_in_init_is_read_from_its_constant_arguments():
    """self.fused = load_inline(...) in __init__ with its sources module-level strings, local strings of __init__
    (also built from each other, an f-string of a module constant), literals: read as the top-level call is, the spec
    held by self.fused."""
    src = init_load()
    ok(src)
    c = Candidate.from_source(src)
    assert c.spec_error is None and [s.var for s in c.specs] == ["self.fused"]
    assert c.kernels == {"self.fused": ("linear_relu",)}
    assert c.specs[0].key() == extract_specs(INLINE)[0].key()  # the same extension as the top-level call
    src_def = INLINE[INLINE.index("linear_relu_src = "):INLINE.index("linear_relu_cpp = ")]
    cpp_def = INLINE[INLINE.index("linear_relu_cpp = "):INLINE.index("fused = load_inline(")]
    local = init_load(mutate(cpp_def, "", mutate(src_def, "", INLINE)),
                      before=src_def.replace("linear_relu_src", "body") + "TILE_N = 16\nhead = f'// tile {TILE_N}\\n'\n"
                      "linear_relu_src = head + body\nflags = ['-O3']\n" + cpp_def,
                      call=CALL_ARGS.replace("verbose=False", "extra_cuda_cflags=flags, verbose=False"))
    ok(local)
    spec = Candidate.from_source(local).specs[0]
    assert spec.cuda_sources[0].startswith("// tile 16\n") and spec.extra_cuda_cflags == ("-O3",)
    qualified = init_load(mutate("from torch.utils.cpp_extension import load_inline\n", "import torch.utils.cpp_extension\n",
                                 INLINE),
                          call=CALL_ARGS.replace("load_inline(", "torch.utils.cpp_extension.load_inline("))
    ok(qualified)
    assert [s.var for s in Candidate.from_source(qualified).specs] == ["self.fused"]


@pytest.mark.parametrize("before,call,says", [
    ("", CALL_ARGS.replace('name="fused_linear_relu"', "name=f'fused_{out_features}'"), "'out_features' is a parameter"),
    ("src = linear_relu_src\nif in_features > 4:\n    src = src + '// wide'\n",
     CALL_ARGS.replace("cuda_sources=linear_relu_src", "cuda_sources=src"), "local name 'src'"),
    ("for src in [linear_relu_src]:\n    pass\n", CALL_ARGS.replace("cuda_sources=linear_relu_src", "cuda_sources=src"),
     "local name 'src'"),
    ("src = make_source()\n", CALL_ARGS.replace("cuda_sources=linear_relu_src", "cuda_sources=src"), "make_source"),
])
def test_load_inline_in_init_with_arguments_known_only_at_run_time_stays_unsupported(before, call, says):
    src = init_load(before=before, call=call)
    if "make_source" in before:
        src = mutate("class ModelNew", "def make_source():\n    return linear_relu_src\n\n\nclass ModelNew", src)
    v = check_candidate(src).first()
    assert v is not None and v.rule == "unsupported-format" and says in v.message, str(v)


@pytest.mark.parametrize("edit,words", [
    ("if", ("inside __init__() other than as `self.<name> = load_inline(...)`",)),  # inside an if
    ("local", ("inside __init__() other than as",)),  # through a local name
    ("helper", ("inside build()",)),  # a method __init__ calls
])
def test_load_inline_elsewhere_says_where_to_move_it(edit, words):
    src = init_load()
    end = "            verbose=False,\n        )\n"
    call = src[src.index("        self.fused = load_inline("):src.index(end) + len(end)]  # the statement, 8 deep
    if edit == "if":
        src = mutate(call, "        if True:\n" + "".join(f"    {ln}\n" for ln in call.splitlines()), src)
    elif edit == "local":
        src = mutate(call, call.replace("self.fused = ", "ext = ") + "        self.fused = ext\n", src)
    else:
        src = mutate(call, "        self.fused = self.build()\n", src)
        src = mutate("    def forward(self, x):", "    def build(self):\n" + call.replace("self.fused = ", "return ")
                     + "\n    def forward(self, x):", src)
    v = check_candidate(src).first()
    assert v is not None and v.rule == "unsupported-format" and all(w in v.message for w in words), str(v)
    assert Candidate.from_source(src).spec_error is not None


def test_load_inline_called_at_run_time_stays_refused():
    """A class run-time code builds whose __init__ calls load_inline: a build at run time (rule forward-torch-op)."""
    helper = ("class Ext:\n    def __init__(self):\n        self.m = " + CALL_ARGS.replace("\n", "\n        ").rstrip()
              + "\n\n\nclass ModelNew")
    src = mutate("fused.linear_relu(", "Ext().m.linear_relu(", mutate("class ModelNew", helper, mutate(LOAD, "", INLINE)))
    refused(src, "forward-torch-op", "load_inline")


def _stub_verifier_prepare(v):
    """Verifier._prepare_inline without the build (as tests/test_honest_corpus.py does): the specs read statically,
    each a compile-only stub."""
    def prepare(candidate):
        modules = [{"key": s.key(), "name": s.name, "module": None, "path": None, "counting": "host",
                    "has_cuda": bool(s.cuda_sources), "kernels": []} for s in candidate.specs]
        return {"modules": modules, "allow_vendor_libraries": False}

    return prepare


def test_the_worker_builds_modelnew_with_load_inline_in_init(verifier):
    """The worker runs __init__'s load_inline with the prebuilt extensions (stubs here): through the imported name, and
    through torch.utils.cpp_extension.load_inline (the stand-in is back while ModelNew is built)."""
    from dice_ray.tasks.loaders import load_tasks

    task = next(t for t in load_tasks("builtin").tasks if t.task_id == "builtin/L2/linear_relu")
    verifier._prepare_inline = _stub_verifier_prepare(verifier)
    try:
        for src in (init_load(), init_load(mutate("from torch.utils.cpp_extension import load_inline\n",
                                                  "import torch.utils.cpp_extension\n", INLINE),
                                           call=CALL_ARGS.replace("load_inline(", "torch.utils.cpp_extension.load_inline("))):
            got = verifier.verify(task, src, "init-load-inline")
            assert got.verdict == "ok", got.reason
    finally:
        del verifier._prepare_inline


# -- 8. torch.autograd.Function wrappers: judged as forward is -------------------------------------------------------
FUNCTION = """class ReLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        y = torch.empty_like(x)
        n = x.numel()
        kernels.relu_kernel(grid=(n + 255) // 256, block=256, args=(x, y, n))
        ctx.save_for_backward(y)
        ctx.n = n
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None
        dx = torch.empty_like(grad)
        kernels.relu_backward(grid=(ctx.n + 255) // 256, block=256, args=(grad.contiguous(), y, dx, ctx.n))
        return dx


class ModelNew"""
BACKWARD_KERNEL = """
extern "C" __global__ void relu_backward(const float* g, const float* y, float* dx, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) dx[i] = y[i] > 0.f ? g[i] : 0.f;
}
\"\"\"
"""
LAUNCH = """        x = x.contiguous()
        y = torch.empty_like(x)
        n = x.numel()
        kernels.relu_kernel(grid=(n + 255) // 256, block=256, args=(x, y, n))
        return y
"""
FN_SRC = mutate(LAUNCH, "        return ReLUFn.apply(x)\n", mutate("class ModelNew", FUNCTION,
                                                                   mutate('}\n"""\n', '}\n' + BACKWARD_KERNEL, HONEST)))


def in_fn_forward(code: str, src: str = FN_SRC) -> str:
    """``src`` with ``code`` (indented 8) before the Function's ``ctx.save_for_backward(y)``."""
    return mutate("        ctx.save_for_backward(y)\n",
                  "".join(f"        {ln}\n" for ln in code.splitlines()) + "        ctx.save_for_backward(y)\n", src)


def test_an_autograd_function_calling_only_kernels_is_accepted():
    """forward and backward launching kernels, ctx.save_for_backward / saved_tensors / needs_input_grad and a field;
    Function imported by name, once_differentiable, the new style (setup_context), a module-level alias of .apply, a
    wrapper deriving from another, and the same in the load_inline format."""
    ok(FN_SRC)
    imported = mutate("class ReLUFn(torch.autograd.Function):", "class ReLUFn(Function):",
                      mutate("    @staticmethod\n    def backward", "    @staticmethod\n    @once_differentiable\n    def backward",
                             at_top("from torch.autograd import Function\nfrom torch.autograd.function import "
                                    "once_differentiable", FN_SRC)))
    ok(imported)
    new_style = mutate("    def forward(ctx, x):\n", "    def forward(x):\n",
                       mutate("        ctx.save_for_backward(y)\n        ctx.n = n\n", "",
                              mutate("    @staticmethod\n    def backward", "    @staticmethod\n    def setup_context(ctx, inputs, "
                                     "output):\n        ctx.save_for_backward(output)\n        ctx.n = output.numel()\n\n"
                                     "    @staticmethod\n    def backward", FN_SRC)))
    ok(new_style)
    alias = mutate("        return ReLUFn.apply(x)\n", "        return relu(x)\n",
                   mutate("\n\nclass ModelNew", "\n\nrelu = ReLUFn.apply\n\n\nclass ModelNew", FN_SRC))
    ok(alias)
    derived = mutate("        return ReLUFn.apply(x)\n", "        return LeakyFn.apply(x)\n",
                     mutate("\n\nclass ModelNew", "\n\nclass LeakyFn(ReLUFn):\n    pass\n\n\nclass ModelNew", FN_SRC))
    ok(derived)
    inline = mutate(CALL_LINE := "        return fused.linear_relu(x, self.weight, self.bias)\n",
                    "        return LinearReLU.apply(x, self.weight, self.bias)\n",
                    mutate("class ModelNew", "class LinearReLU(torch.autograd.Function):\n    @staticmethod\n"
                           "    def forward(ctx, x, w, b):\n        ctx.save_for_backward(x, w)\n"
                           "        return fused.linear_relu(x, w, b)\n\n\nclass ModelNew", INLINE))
    assert CALL_LINE
    ok(inline)
    from dice_ray.verify.rules.allowlist import import_allowed as allowed

    assert allowed("torch.autograd", ("Function",)) and allowed("torch.autograd.function", ("once_differentiable",))
    assert not allowed("torch.autograd", ("grad",)) and not allowed("torch.autograd", ())


def test_an_autograd_functions_methods_are_run_time_code():
    """torch calls them (X.apply, the backward pass) without the candidate's code mentioning them: never construction
    code, even when __init__ calls one (its torch compute is refused there too)."""
    from dice_ray.verify.rules.python_rules import _reserved_names

    assert {"forward", "backward", "setup_context", "jvp", "vjp", "vmap"} <= _reserved_names()
    src = in_init("g = ReLUFn.backward(None, torch.ones(2))", FN_SRC)
    tree = ast.parse(src)
    cons = construction_code(tree, dead_code(tree), _reserved_names())
    fns = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert id(fns["backward"]) not in cons.functions and id(fns["__init__"]) in cons.functions
    refused(mutate("        return dx\n", "        return dx.relu()\n", src), "forward-torch-op", ".relu()")


@pytest.mark.parametrize("src,rule,words", [
    (in_fn_forward("y = torch.matmul(y, y)"), "forward-torch-op", ("torch.matmul",)),
    (at_top("import torch.nn.functional as F", in_fn_forward("y = F.relu(y)")), "forward-torch-op", ("relu",)),
    (in_fn_forward("s = y.sum()"), "forward-torch-op", (".sum()",)),
    (mutate("        return dx\n", "        return dx * y.gt(0)\n", FN_SRC), "forward-torch-op", (".gt()",)),
    (in_fn_forward("y = Model()(x)"), "reference-model", ()),  # a Function hiding the reference
    (in_fn_forward("ReLUFn.cache = y"), "forward-state", ("ReLUFn.cache",)),  # a cached output
    (mutate("    def forward(ctx, x):\n", "    def forward(ctx, x, seen={}):\n", FN_SRC), "forward-state", ("mutable",)),
    (mutate("        return ReLUFn.apply(x)\n", "        return ReLUFn.apply(x, self.act)\n",
            mutate("    def forward(ctx, x):\n", "    def forward(ctx, x, act):\n        x = act(x)\n", FN_SRC)),
     "forward-module-call", ("act",)),  # a submodule handed to the Function
    (in_fn_forward("k = ctx.next_functions"), "dynamic-code", ("ctx.next_functions",)),
    (in_fn_forward("keep = [ctx]"), "dynamic-code", ("as a value",)),
    (in_fn_forward("ctx.to_save = (y,)"), "patching", ("ctx.to_save",)),
    (mutate("        return ReLUFn.apply(x)\n", "        b = ReLUFn._backward_cls\n        return ReLUFn.apply(x)\n", FN_SRC),
     "dynamic-code", ("_backward_cls",)),
    (mutate("        return ReLUFn.apply(x)\n", "        b = ReLUFn.vjp(None, x)\n        return ReLUFn.apply(x)\n", FN_SRC),
     "forward-module-call", ("ReLUFn.vjp",)),
    (mutate("        return ReLUFn.apply(x)\n", "        return self.apply(ReLUFn.apply)\n", FN_SRC), "forward-module-call", ()),
    # a ctx method called directly: the object handed as ctx (a submodule) would keep its fields across calls
    (mutate("        return ReLUFn.apply(x)\n", "        ReLUFn.backward(self.act, x)\n        return ReLUFn.apply(x)\n",
            FN_SRC), "forward-module-call", ("directly",)),
    (mutate("        return ReLUFn.apply(x)\n", "        z = list(map(ReLUFn.backward, [x], [x]))\n"
            "        return ReLUFn.apply(x)\n", FN_SRC), "forward-module-call", ("map",)),
    (at_top("from torch.autograd import grad", mutate("        return dx\n", "        return grad(dx, y)\n", FN_SRC)),
     "forbidden-import", ()),
    (mutate("torch.autograd.Function", "torch.autograd.function.InplaceFunction", FN_SRC), "base-class", ()),
    (mutate("(torch.autograd.Function)", "(torch.autograd.Function, nn.Module)", FN_SRC), "base-class", ("nn.Module",)),
    (mutate("class ModelNew(nn.Module):", "class ModelNew(torch.autograd.Function):", FN_SRC), "base-class", ()),
    (mutate("        return ReLUFn.apply(x)\n", "        class G(torch.autograd.Function):\n            pass\n"
            "        return ReLUFn.apply(x)\n", FN_SRC), "base-class", ("class G",)),
    (mutate("class ModelNew(nn.Module):", "class ModelNew(torch.Tensor):", FN_SRC), "base-class", ()),
])
def test_autograd_function_near_misses_stay_refused(src, rule, words):
    refused(src, rule, *words)


def test_an_autograd_function_runs_in_the_dry_run(verifier):
    """Compile-only: ReLUFn.apply(x) on meta tensors launches (checked) the forward kernel; a torch op the static
    rules cannot see in the Function's forward (+ on tensors) is refused there, as in ModelNew.forward."""
    from dice_ray.tasks.task import Task

    task = Task("test/relu", "relu", 1, RELU_REF)
    got = verifier.verify(task, FN_SRC, "autograd-function")
    assert got.verdict == "ok" and "dry run ok" in got.reason, got.reason
    got = verifier.verify(task, mutate("        return y\n\n    @staticmethod", "        return y + 0\n\n    @staticmethod",
                                       FN_SRC), "autograd-function-add")
    assert got.verdict == "cheat" and got.rule == "forward-torch-op" and "add" in got.reason, got.reason
