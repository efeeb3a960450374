"""Static anti-cheat rules: each rule caught by a small candidate; honest candidates pass."""

from __future__ import annotations

import pytest

from _verify_sources import HONEST, mutate
from dice_ray.verify.rules.catalog import RULES
from dice_ray.verify.rules.check import check_candidate

FWD = "        return y\n"


def in_forward(code: str) -> str:
    """HONEST with ``code`` (indented 8) inserted before ``return y``."""
    lines = "".join(f"        {ln}\n" for ln in code.splitlines())
    return mutate(FWD, lines + FWD)


def at_top(code: str) -> str:
    return mutate("import torch\n", f"import torch\n{code}\n")


def imported(code: str, use: str) -> str:
    """HONEST with the import ``code`` at top level and ``use`` of it in forward (an import nothing uses never
    runs: dice_ray.verify.candidate.liveness)."""
    return mutate("import torch\n", f"import torch\n{code}\n", in_forward(use))


CORPUS = [
    # (name, candidate source, rule that must be reported)
    ("try-except fallback", mutate(
        "        kernels.relu_kernel(grid=(n + 255) // 256, block=256, args=(x, y, n))\n",
        "        try:\n            kernels.relu_kernel(grid=(n + 255) // 256, block=256, args=(x, y, n))\n"
        "        except Exception:\n            y = torch.relu(x)\n"), "try-except"),
    ("torch.matmul in forward", in_forward("y = torch.matmul(y, y)"), "forward-torch-op"),
    ("F.relu in forward", mutate("import torch.nn as nn\n", "import torch.nn as nn\nimport torch.nn.functional as F\n",
                                 in_forward("y = F.relu(y)")), "forward-torch-op"),
    ("tensor method in forward", in_forward("y = y.sum()"), "forward-torch-op"),
    ("cast in forward", in_forward("y = y.half()"), "forward-torch-op"),
    ("@ operator", in_forward("y = y @ y"), "forward-torch-op"),
    ("torch op in helper", mutate("class ModelNew", "def helper(t):\n    return torch.softmax(t, 0)\n\n\nclass ModelNew",
                                  in_forward("y = helper(y)")), "forward-torch-op"),
    ("inherit reference Model", mutate("class ModelNew(nn.Module):", "class ModelNew(Model):"), "reference-model"),
    ("call reference Model", in_forward("y = Model()(x)"), "reference-model"),
    ("inherit nn.Linear", mutate("class ModelNew(nn.Module):", "class ModelNew(nn.Linear):"), "base-class"),
    ("submodule call", in_forward("y = self.act(y)"), "forward-module-call"),
    (".forward call", in_forward("y = super().forward(y)"), "forward-module-call"),
    ("threading", imported("import threading", "threading.Thread(target=print).start()"), "forbidden-import"),
    ("multiprocessing", imported("import multiprocessing as mp", "mp.Process(target=print).start()"), "forbidden-import"),
    ("subprocess", imported("from subprocess import run", "run(['true'])"), "forbidden-import"),
    ("os", imported("import os", "os.getpid()"), "forbidden-import"),
    ("sys", imported("import sys", "sys.exit(0)"), "forbidden-import"),
    ("ctypes", imported("import ctypes", "ctypes.memset(0, 0, 1)"), "forbidden-import"),
    ("socket", imported("import socket", "socket.socket()"), "forbidden-import"),
    ("time", imported("import time", "time.sleep(0)"), "forbidden-import"),
    ("dice_ray internals", imported("from dice_ray import launch", "launch.configure(dry_run=True)"), "forbidden-import"),
    ("launch counter import", imported("from dice_ray.launch import launch_count", "launch_count()"),
     "forbidden-import"),
    ("import inside forward", in_forward("import numpy\nnumpy.zeros(1)"), "forbidden-import"),
    ("cuda stream", in_forward("s = torch.cuda.Stream()"), "cuda-stream"),
    ("stream context", in_forward("with torch.cuda.stream(torch.cuda.Stream()):\n    pass"), "cuda-stream"),
    ("cuda event", in_forward("e = torch.cuda.Event()"), "cuda-stream"),
    ("cuda graph", in_forward("g = torch.cuda.CUDAGraph()"), "cuda-stream"),
    ("pinned host memory", in_forward("f = torch.zeros(1, dtype=torch.int32, pin_memory=True)"), "host-memory"),
    ("pinned host memory in __init__", mutate("        super().__init__()\n",
                                              "        super().__init__()\n        self.f = torch.zeros(1, pin_memory=1)\n"),
     "host-memory"),
    ("patch time.perf_counter", at_top("import time\ntime.perf_counter = lambda: 0.0"), "patching"),
    ("patch torch", mutate("        super().__init__()\n",
                           "        super().__init__()\n        torch.cuda.synchronize = lambda *a: None\n"), "patching"),
    ("tf32 switch", mutate("        super().__init__()\n",
                           "        super().__init__()\n        torch.backends.cuda.matmul.allow_tf32 = True\n"), "patching"),
    ("global precision", mutate("        super().__init__()\n",
                                "        super().__init__()\n        torch.set_float32_matmul_precision('medium')\n"),
     "patching"),
    ("patch kernel module", mutate("        super().__init__()\n",
                                   "        super().__init__()\n        kernels.relu_kernel = None\n"), "patching"),
    ("open()", in_forward("open('/tmp/x', 'w').write('1')"), "file-access"),
    ("eval", in_forward("y = eval('x')"), "dynamic-code"),
    ("exec", in_forward("exec('import os')"), "dynamic-code"),
    ("__import__", in_forward("__import__('os').system('true')"), "dynamic-code"),
    ("getattr trick", in_forward("f = getattr(torch, 'relu')"), "dynamic-code"),
    ("dunder walk", in_forward("b = ().__class__.__bases__[0].__subclasses__()"), "dynamic-code"),
    ("torch.ops", in_forward("y = torch.ops.aten.relu(x)"), "torch-internals"),
    ("torch.compile", mutate("        super().__init__()\n",
                             "        super().__init__()\n        self.f = torch.compile(torch.relu)\n"), "torch-internals"),
    ("cache on self", in_forward("self.cached = y"), "forward-state"),
    ("cache via container", mutate("        super().__init__()\n", "        super().__init__()\n        self.c = []\n",
                                   in_forward("self.c.append(y)")), "forward-state"),
    ("global statement", in_forward("global CACHE"), "forward-state"),
    # a tensor of self's changed in place: a call counter that switches the computation after the correctness trials
    ("call counter in a tensor", in_forward("n = self.calls.item()\nself.calls.fill_(n + 1)"), "forward-state"),
    ("counter through a name", in_forward("c = self.calls\nc.zero_()"), "forward-state"),
    ("counter through a view", in_forward("v = self.calls.view(-1)\nv.fill_(1)"), "forward-state"),
    ("mutable default", mutate("def forward(self, x):", "def forward(self, x, _cache={}):"), "forward-state"),
    ("module-level cache", at_top("CACHE = {}"), "module-state"),
    ("top-level call", at_top("torch.manual_seed(0)"), "module-state"),
    ("cuBLAS include", mutate('cuda_source = r"""\n', 'cuda_source = r"""\n#include <cublas_v2.h>\n'), "cuda-library"),
    ("CUTLASS include", mutate('cuda_source = r"""\n', 'cuda_source = r"""\n#include "cutlass/gemm/device/gemm.h"\n'),
     "cuda-library"),
    ("thrust include", mutate('cuda_source = r"""\n', 'cuda_source = r"""\n#include <thrust/sort.h>\n'), "cuda-library"),
    ("cuDNN include", mutate('cuda_source = r"""\n', 'cuda_source = r"""\n#include <cudnn.h>\n'), "cuda-library"),
    ("include by absolute path", mutate('cuda_source = r"""\n', 'cuda_source = r"""\n#include "/etc/passwd"\n'),
     "file-access"),
    ("no kernel launched", mutate("        kernels.relu_kernel(grid=(n + 255) // 256, block=256, args=(x, y, n))\n",
                                  "        y.zero_()\n"), "no-kernel-launch"),
    ("load_inline", at_top("from torch.utils.cpp_extension import load_inline"), "unsupported-format"),
    ("load_inline host C++ computes with ATen", (
        "import torch\nfrom torch.utils.cpp_extension import load_inline\n"
        "src = '__global__ void k(float* y) {}\\n"
        "torch::Tensor f(torch::Tensor x) { auto y = at::matmul(x, x); k<<<1, 1>>>(y.data_ptr<float>()); return y; }'\n"
        "ext = load_inline(name='e', cpp_sources='torch::Tensor f(torch::Tensor x);', cuda_sources=src, functions=['f'])\n"
        "class ModelNew(torch.nn.Module):\n    def forward(self, x):\n        return ext.f(x)\n"), "cpp-torch-op"),
    # torch ops and submodules reached through values (names, class attributes, subscripts, map/key=)
    ("torch op bound at top level", mutate(FWD, "        return R(y)\n", at_top("R = torch.relu")), "forward-torch-op"),
    ("torch op bound in forward", in_forward("f = torch.relu\ny = f(y)"), "forward-torch-op"),
    ("from-import op as a value", mutate("import torch\n", "import torch\nfrom torch.nn.functional import gelu\n",
                                        in_forward("y = list(map(gelu, [y]))[0]")), "forward-torch-op"),
    ("torch op as class attribute", mutate("class ModelNew(nn.Module):\n", "class ModelNew(nn.Module):\n    act = torch.relu\n",
                                           mutate(FWD, "        return ModelNew.act(y)\n")), "forward-torch-op"),
    ("forward rebound to nn.ReLU.forward", mutate(FWD, FWD + "\n    forward = nn.ReLU.forward\n"), "forward-torch-op"),
    ("bound tensor method", in_forward("f = y.relu\ny = f()"), "forward-torch-op"),
    ("class attribute call", mutate("class ModelNew(nn.Module):\n", "class ModelNew(nn.Module):\n    act = 1\n",
                                    in_forward("y = ModelNew.act(y)")), "forward-module-call"),
    ("init op through a local", mutate("        super().__init__()\n", "        super().__init__()\n        self.f = torch.relu\n",
                                       in_forward("f = self.f\ny = f(y)")), "forward-module-call"),
    ("submodule through a subscript", in_forward("y = (self.act,)[0](y)"), "forward-module-call"),
    ("submodule through _modules", in_forward("y = self._modules['act'](y)"), "forward-module-call"),
    ("submodule _call_impl", in_forward("y = self.act._call_impl(y)"), "forward-module-call"),
    ("submodule handed to map", in_forward("y = next(map(self.act, [y]))"), "forward-module-call"),
    ("submodule as sort key", in_forward("y = sorted([y], key=self.act)[0]"), "forward-module-call"),
    ("submodule through a parameter", mutate("def forward(self, x):", "def forward(self, x, act=None):",
                                             in_forward("y = act(y)")), "forward-module-call"),
    ("helper calls its parameter", mutate("class ModelNew", "def run(f, t):\n    return f(t)\n\n\nclass ModelNew",
                                          in_forward("y = run(self.act, y)")), "forward-module-call"),
    # tables of kernels and kernel attributes that something else gets into
    ("kernel table stored into", in_forward("t = [kernels.relu_kernel]\nt[0] = self.act\ny = t[0](y)"), "forward-module-call"),
    ("kernel table passed on", in_forward("t = [kernels.relu_kernel]\nu = t\nu[0] = self.act\ny = t[0](y)"),
     "forward-module-call"),
    ("kernel table with a submodule", in_forward("t = (kernels.relu_kernel, self.act)\ny = t[1](y)"), "forward-module-call"),
    ("kernel table .get default", in_forward("t = {0: kernels.relu_kernel}\ny = t.get(1, self.act)(y)"),
     "forward-module-call"),
    ("kernel attribute rebound", mutate("        super().__init__()\n", "        super().__init__()\n        self.act = nn.ReLU()\n"
                                        "        self.k = kernels.relu_kernel\n        self.k = self.act\n",
                                        in_forward("y = self.k(y)")), "forward-module-call"),
    ("self kernel table stored into", mutate("        super().__init__()\n", "        super().__init__()\n"
                                             "        self.act = nn.ReLU()\n        self.t = [kernels.relu_kernel]\n"
                                             "        self.t[0] = self.act\n", in_forward("y = self.t[0](y)")),
     "forward-module-call"),
    # modules reached through attribute expressions, str.format field walks
    ("module bound by attribute", at_top("F = torch.nn.functional"), "dynamic-code"),
    ("module attribute as value", in_forward("m = torch.nn\nm.functional.torch.os.system('id')"), "dynamic-code"),
    ("format field walk", in_forward("s = '{0.__repr__.__globals__[torch].os.environ}'.format(y)"), "dynamic-code"),
    ("format field walk at top level", at_top("LEAK = '{0.__globals__}'.format(torch.zeros)"), "dynamic-code"),
    ("format_map field walk", in_forward("s = '{a.__class__}'.format_map({'a': y})"), "dynamic-code"),
    ("format field in a spec", in_forward("s = '{0:{1.__class__}}'.format(1, y)"), "dynamic-code"),
    ("str.format with a built template", in_forward("t = '{0.__cl' + 'ass__}'\ns = t.format(y)"), "dynamic-code"),
    ("str.format unbound", in_forward("s = str.format('{0.__class__}', y)"), "dynamic-code"),
    # strings evaluated as code (typing evaluates string annotations with real imports)
    ("string annotation evaluated", mutate("import torch\n", "import torch\nimport typing\n", mutate(
        "class ModelNew(nn.Module):\n", "class ModelNew(nn.Module):\n    hint: \"__import__('os')\"\n",
        in_forward("os = typing.get_type_hints(ModelNew)['hint']"))), "dynamic-code"),
    ("get_type_hints imported by name", mutate("import torch\n", "import torch\nfrom typing import get_type_hints\n",
                                              in_forward("h = get_type_hints(ModelNew)")), "dynamic-code"),
    ("ForwardRef evaluated in __init__", mutate("import torch\n", "import torch\nimport typing\n", mutate(
        "        super().__init__()\n", "        super().__init__()\n        self.s = typing.get_args(typing.List['sys'])[0]"
        "._evaluate(None, None, frozenset())\n")), "dynamic-code"),
    ("private typing helper", mutate("import torch\n", "import torch\nimport typing\n",
                                     in_forward("e = typing._eval_type")), "dynamic-code"),
    # classes, objects and self patched or stored into under another name
    ("torch class patched through a local", mutate("        super().__init__()\n", "        super().__init__()\n"
                                                   "        m = nn.Module\n        m._call_impl = None\n"), "patching"),
    ("submodule's class patched", mutate("        super().__init__()\n", "        super().__init__()\n"
                                         "        self.act = nn.ReLU()\n        type(self.act).forward = lambda s, t: t\n"),
     "patching"),
    ("tensor class patched in forward", in_forward("t = type(x)\nt.relu = None"), "patching"),
    ("forward replaced on the instance", mutate("        super().__init__()\n", "        super().__init__()\n"
                                                "        self.forward = torch.relu\n"), "patching"),
    ("self under another name", in_forward("s = self\ns.cached = y"), "forward-state"),
    ("self handed to a helper that stores", mutate(
        "class ModelNew", "def stash(m, v):\n    m.cached = v\n\n\nclass ModelNew", in_forward("stash(self, y)")), "patching"),
    ("class attribute stored in forward", in_forward("ModelNew.cached = y"), "forward-state"),
    ("mutable default inside a tuple", mutate("def forward(self, x):", "def forward(self, x, _c=([],)):"), "forward-state"),
    ("stream from a module returned by a call", mutate("        super().__init__()\n", "        super().__init__()\n"
                                                      "        self.s = torch.get_device_module('cuda').Stream()\n"),
     "dynamic-code"),
    ("module-returning call taken as a value", mutate("        super().__init__()\n", "        super().__init__()\n"
                                                      "        g = torch.get_device_module\n        self.s = g('cuda')\n"),
     "dynamic-code"),
    # process-wide torch hooks and settings the reference shares
    ("global module forward hook", mutate("class ModelNew", "def hook(m, args, out):\n    return torch.zeros_like(out)\n\n\n"
                                          "class ModelNew", mutate("        super().__init__()\n", "        super().__init__()\n"
                                                                   "        nn.modules.module.register_module_forward_hook(hook)\n")),
     "patching"),
    ("global hook taken as a value", mutate("        super().__init__()\n", "        super().__init__()\n"
                                            "        reg = nn.modules.module.register_module_forward_pre_hook\n"), "patching"),
    ("global hook in a class body", mutate("class ModelNew(nn.Module):\n", "class ModelNew(nn.Module):\n"
                                           "    torch.nn.modules.module.register_module_forward_hook(print)\n"), "patching"),
    ("autograd global setting", mutate("        super().__init__()\n", "        super().__init__()\n"
                                       "        torch.autograd.set_detect_anomaly(True)\n"), "patching"),
    ("GEMM tuning", mutate("        super().__init__()\n", "        super().__init__()\n        torch.cuda.tunable.enable(True)\n"),
     "patching"),
    ("no ModelNew", mutate("class ModelNew(", "class Solution("), "no-modelnew"),
    ("python syntax", mutate("def forward(self, x):", "def forward(self, x)"), "syntax"),
]


@pytest.mark.parametrize("name,src,rule", CORPUS, ids=[c[0] for c in CORPUS])
def test_cheat_corpus_caught(name, src, rule):
    report = check_candidate(src)
    rules = [v.rule for v in report.violations]
    assert rule in rules, f"{name}: expected {rule}, got {[str(v) for v in report.violations]}"
    assert not report.ok and report.first() is not None
    assert report.first().verdict == RULES[report.first().rule].verdict


def test_every_static_rule_has_a_corpus_entry():
    dynamic_only = {"unknown-kernel", "input-mutation", "output-type", "precision-downgrade", "timing-audit",
                    "kernel-not-used"}
    covered = {c[2] for c in CORPUS}
    assert set(RULES) - dynamic_only <= covered, set(RULES) - dynamic_only - covered


def test_honest_candidates_pass():
    report = check_candidate(HONEST)
    assert report.ok, [str(v) for v in report.violations]
    assert report.kernel_refs == {"kernels": {"relu_kernel"}}
    shadow = mutate("def forward(self, x):\n        x = x.contiguous()",
                    "def forward(self, input):\n        x = input.contiguous()")  # `input` as an argument
    assert check_candidate(shadow).ok
    helper = mutate("class ModelNew", "def cdiv(a, b):\n    return (a + b - 1) // b\n\n\nclass ModelNew")
    helper = mutate("grid=(n + 255) // 256", "grid=cdiv(n, 256)", helper)
    assert check_candidate(helper).ok


LAUNCH = "        kernels.relu_kernel(grid=(n + 255) // 256, block=256, args=(x, y, n))\n"
HONEST_VARIANTS = [
    ("kernel alias", mutate(LAUNCH, "        k = kernels.relu_kernel\n" + LAUNCH.replace("kernels.relu_kernel", "k"))),
    ("kernel choice", mutate(LAUNCH, "        k = kernels.relu_kernel if n else kernels.relu_kernel\n"
                                     + LAUNCH.replace("kernels.relu_kernel", "k"))),
    ("kernel loop", mutate(LAUNCH, "        for k in (kernels.relu_kernel, kernels.relu_kernel):\n    "
                                   + LAUNCH.replace("kernels.relu_kernel", "k"))),
    ("helper takes the kernel", mutate(
        "class ModelNew", "def launch(kernel, n, *args):\n    kernel(grid=(n + 255) // 256, block=256, args=args)\n\n\n"
        "class ModelNew", mutate(LAUNCH, "        launch(kernels.relu_kernel, n, x, y, n)\n"))),
    ("method takes the kernel", mutate(
        "    def forward(self, x):", "    def _go(self, kernel, n, *args):\n"
        "        kernel(grid=(n + 255) // 256, block=256, args=args)\n\n    def forward(self, x):",
        mutate(LAUNCH, "        self._go(kernels.relu_kernel, n, x, y, n)\n"))),
    ("template .format", mutate("kernels = load_cuda(cuda_source)", 'T = r"""__global__ void f() {{ int b = {BLOCK}; }}"""\n'
                                'SRC = T.format(BLOCK=256)\nkernels = load_cuda(cuda_source)')),
    ("messages", in_forward("if y.dim() > 4:\n    raise ValueError('bad shape {}'.format(tuple(y.shape)) + f'{y.dtype}')")),
    ("builtins and lambdas", in_forward("m = max(1, min(n, 1024))\nd = sorted(range(y.dim()), key=lambda i: -i)\n"
                                        "w = list(map(int, y.shape))\nq = isinstance(y, torch.Tensor)")),
    ("torch in __init__", mutate("        super().__init__()\n", "        super().__init__()\n        self.w = nn.Parameter("
                                 "torch.empty(4, 4))\n        nn.init.kaiming_uniform_(self.w)\n        self.f = torch.relu\n")),
    ("decorators and annotations", mutate("    def forward(self, x):", "    @torch.no_grad()\n"
                                          "    def forward(self, x: torch.Tensor) -> torch.Tensor:")),
    ("static method through the class", mutate(
        "    def forward(self, x):", "    @staticmethod\n    def grid(n):\n        return (n + 255) // 256\n\n"
        "    def forward(self, x):", mutate("grid=(n + 255) // 256", "grid=ModelNew.grid(n)"))),
    ("local def", in_forward("def g(a):\n    return a + 1\nm = g(3)\ns = ','.join(str(d) for d in y.shape)")),
    ("kernel kept in an attribute", mutate("        super().__init__()\n", "        super().__init__()\n"
                                           "        self.k = kernels.relu_kernel\n",
                                           mutate(LAUNCH, LAUNCH.replace("kernels.relu_kernel", "self.k")))),
    ("kernel table by dtype", mutate(LAUNCH, "        table = {torch.float32: kernels.relu_kernel}\n"
                                     + LAUNCH.replace("kernels.relu_kernel", "table[x.dtype]"))),
    ("kernel list", mutate(LAUNCH, "        ks = [kernels.relu_kernel, kernels.relu_kernel]\n        k = ks[n % 2]\n"
                           + LAUNCH.replace("kernels.relu_kernel", "k"))),
    ("typing annotations and super(Class, self)", mutate("import torch\n", "import torch\nfrom typing import List, Optional\n",
                                                         mutate("        super().__init__()\n",
                                                                "        super(ModelNew, self).__init__()\n"
                                                                "        self.register_buffer('b', torch.zeros(1))\n"
                                                                "        self.sizes: List[int] = [1]\n",
                                                                mutate("def forward(self, x):",
                                                                       "def forward(self, x: 'torch.Tensor', s: Optional"
                                                                       "[int] = None, dims=(0, 1)) -> torch.Tensor:")))),
    ("local lists stored into", in_forward("shape = list(y.shape)\nshape[0] = 1\nargs = [x, y]\nargs[0] = y\n"
                                           "(a, b), c = (1, 2), 3")),
    ("kernel table in an attribute", mutate("        super().__init__()\n", "        super().__init__()\n"
                                            "        self.table = (kernels.relu_kernel,)\n",
                                            mutate(LAUNCH, LAUNCH.replace("kernels.relu_kernel", "self.table[0]")))),
]


@pytest.mark.parametrize("name,src", HONEST_VARIANTS, ids=[c[0] for c in HONEST_VARIANTS])
def test_honest_variants_pass(name, src):
    """Kernels through names, helpers and loops; templates; builtins; torch in __init__: no rule."""
    report = check_candidate(src)
    assert report.ok, f"{name}: {[str(v) for v in report.violations]}"


def test_init_may_use_torch_and_kernel_holder_attribute():
    src = mutate("    def __init__(self):\n        super().__init__()\n",
                 "    def __init__(self):\n        super().__init__()\n        self.k = kernels\n"
                 "        self.w = nn.Parameter(torch.randn(4, 4).relu())\n")
    src = mutate("kernels.relu_kernel(", "self.k.relu_kernel(", src)
    report = check_candidate(src)
    assert report.ok, [str(v) for v in report.violations]
    assert report.kernel_refs == {"self.k": {"relu_kernel"}}


def test_cheat_rules_decide_before_compile_error_rules():
    """A cheat in a module that also lacks ModelNew is a cheat (both are reported)."""
    src = mutate("class ModelNew(", "class Solution(", imported("import os", "os.getpid()"))
    report = check_candidate(src)
    assert report.first().rule == "forbidden-import" and "no-modelnew" in {v.rule for v in report.violations}
    assert check_candidate(mutate("class ModelNew(", "class Solution(")).first().rule == "no-modelnew"


def test_builtin_suite_solutions_pass():
    from dice_ray.tasks.loaders import load_tasks

    tasks = [t for t in load_tasks("builtin").tasks if t.solution_format == "fast"]
    assert tasks
    bad = {t.task_id: [str(v) for v in check_candidate(t.solution_src).violations] for t in tasks}
    assert not {k: v for k, v in bad.items() if v}


def test_one_value_read_back_with_cpu_item_is_launch_code():
    """x.cpu().item() reads one value as x.item() does (run time: a one-element copy, replayed in the kernel
    ablation); .cpu() kept as a tensor, or of anything but a value read, is a torch op."""
    assert check_candidate(in_forward("s = y.cpu().item()\ns = y[0, 0].cpu().item()")).ok
    for code in ("h = y.cpu()", "s = y.cpu().sum()", "s = y.cpu().numpy()"):
        assert check_candidate(in_forward(code)).first().rule == "forward-torch-op", code


def test_private_weight_init_helpers_are_allowed_where_torch_is():
    """nn.Linear.reset_parameters' own helper, used to initialise a candidate's weights like the reference's."""
    init = mutate("        super().__init__()\n", "        super().__init__()\n        self.w = nn.Parameter(torch.empty(4, 4))\n"
                  "        fan_in, _ = nn.init._calculate_fan_in_and_fan_out(self.w)\n")
    assert check_candidate(init).ok, [str(v) for v in check_candidate(init).violations]
    assert check_candidate(in_forward("f, _ = nn.init._calculate_fan_in_and_fan_out(y)")).first().rule == \
        "forward-torch-op"
    assert "torch-internals" in {v.rule for v in check_candidate(in_forward("f = nn.init._no_grad_zero_(y)")).violations}
