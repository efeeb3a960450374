"""The load_inline (KernelBench / DICE) candidate format on CPU: extraction, hashing, the compile
pool (cache, parallel builds, errors, limits), launch counters, C++ rules, worker-side loading."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from dice_ray.verify.candidate import inline_spec
from dice_ray.verify.candidate.inline_build import InlineBuilder
from dice_ray.verify.candidate.inline_counters import instrument_cuda
from dice_ray.verify.candidate.inline_spec import InlineSpec, UnsupportedFormat, extract_specs, spec_from_call
from dice_ray.verify.rules.check import check_candidate
from dice_ray.verify.trials import inline_launches as inline
from dice_ray.verify.trials.execution import exec_inline

KERNEL = r'''
#include <torch/extension.h>

__global__ void relu_kernel(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] > 0.f ? x[i] : 0.f;
}

torch::Tensor relu_cuda(torch::Tensor x) {
    auto y = torch::empty_like(x);
    int n = x.numel();
    relu_kernel<<<(n + 255) / 256, 256>>>(x.contiguous().data_ptr<float>(), y.data_ptr<float>(), n);
    return y;
}
'''

CANDIDATE = f'''
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

source = """{KERNEL}"""
cpp_src = "torch::Tensor relu_cuda(torch::Tensor x);"

relu_ext = load_inline(
    name="relu_ext",
    cpp_sources=cpp_src,
    cuda_sources=source,
    functions=["relu_cuda"],
    verbose=True,
)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.ext = relu_ext

    def forward(self, x):
        return self.ext.relu_cuda(x)
'''

#: a tiny spec that compiles in seconds: no torch headers (pybind11 only), a plain CUDA kernel
FAST_CPP = "#include <pybind11/pybind11.h>\nint launch(int n);"
FAST_CUDA = r'''
__global__ void fill(float* y, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] = 1.f; }
int launch(int n) { float* y = nullptr; fill<<<1, 32>>>(y, n); return n; }
'''


def fast_spec(tag: str = "a", cuda: str = FAST_CUDA) -> InlineSpec:
    return InlineSpec(name=f"fast_{tag}", cpp_sources=(FAST_CPP,), cuda_sources=(cuda + f"// {tag}\n",),
                      functions=("launch",), no_implicit_headers=True)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("inline-cache")


def builder(cache, **kw) -> InlineBuilder:
    opts = dict(link=False, pch=False, max_builds=2, timeout_s=120.0)
    opts.update(kw)
    return InlineBuilder(cache, **opts)


# -- static extraction --------------------------------------------------------------------------
def test_extract_literals_names_concatenation():
    src = '''
from torch.utils.cpp_extension import load_inline
HEAD = """#include <torch/extension.h>
"""
BODY = HEAD + "__global__ void k() {}\\n"
N = 256
decl = f"int f(int n = {N});"
ext = load_inline(name="e", cpp_sources=[decl, "int g();"], cuda_sources=BODY + "int f(int n) { return n; }",
                  functions={"f": "doc", "g": "doc"}, extra_cuda_cflags=["-O3", "--use_fast_math"], verbose=False)
'''
    (spec,) = extract_specs(src)
    assert spec.name == "e" and spec.var == "ext" and spec.line == 8
    assert spec.cpp_sources == ("int f(int n = 256);", "int g();")
    assert spec.cuda_source.startswith("#include <torch/extension.h>\n__global__ void k() {}\n")
    assert spec.functions == ("f", "g") and spec.extra_cuda_cflags == ("-O3", "--use_fast_math")
    assert inline_spec.is_inline(src) and not inline_spec.is_inline("import torch\n")


def test_extract_every_dice_infilling_record(dice_data):
    records = json.loads((dice_data / "kernel_infilling_evaluation.json").read_text())
    assert len(records) == 99
    for r in records:
        (spec,) = extract_specs(r["cuda_code"])
        assert spec.cuda_sources and spec.functions and spec.var
        assert "__global__" in spec.cuda_source or "cublas" in spec.cuda_source.lower() or "cudnn" in spec.cuda_source


@pytest.mark.parametrize("call, argument", [
    ('load_inline(name="e", cpp_sources=make(), cuda_sources="", functions=["f"])', "cpp_sources"),
    ('load_inline(name="e", cpp_sources="", cuda_sources=SRC.upper(), functions=["f"])', "cuda_sources"),
    ('load_inline(name=NAME, cpp_sources="", functions=["f"])', "name"),
    ('load_inline(name="e", cpp_sources="", functions=FNS)', "functions"),
    ('load_inline(name="e", cpp_sources="", functions=["f"], extra_include_paths=["/etc"])', "extra_include_paths"),
    ('load_inline(name="e", cpp_sources="", functions=["f"], extra_cflags=["-I/usr"])', "extra_cflags"),
    ('load_inline(**kw)', "arguments"),
])
def test_dynamic_arguments_are_unsupported(call, argument):
    src = f'''import os
from torch.utils.cpp_extension import load_inline
SRC = "x"
NAME = os.environ["X"]
FNS = ["f"]
FNS = FNS + ["g"]
ext = {call}
'''
    with pytest.raises(UnsupportedFormat) as e:
        extract_specs(src)
    assert e.value.argument == argument and e.value.rule == "unsupported-format" and argument in str(e.value)
    report = check_candidate(src + "class ModelNew:\n    pass\n")
    assert "unsupported-format" in {v.rule for v in report.violations}
    assert report.first().rule == "forbidden-import"  # os.environ read at top level: a cheat decides before a format error


def test_flag_lists_are_read_as_torchs_build_reads_them():
    """load_inline joins a flag list into its ninja command line: an empty item (KernelBench's own example has
    extra_cflags=[""], extra_ldflags=[""]) is no flag, an item with spaces several; libraries every extension
    links anyway are dropped from extra_ldflags; each argument's error says what that argument accepts."""
    def spec(**kw):
        return spec_from_call(("e", "int f();", "__global__ void k() {}"), {"functions": ["f"], **kw})

    s = spec(extra_cflags=["", " "], extra_ldflags=[""], extra_cuda_cflags=["-O3 --use_fast_math", "-Xptxas -O3",
                                                                          "-Xptxas=-v,-O3", "-Xcompiler=-O3,-Wall"])
    assert s.extra_cflags == () and s.extra_ldflags == ()
    assert s.extra_cuda_cflags == ("-O3", "--use_fast_math", "-Xptxas", "-O3", "-Xptxas=-v,-O3", "-Xcompiler=-O3,-Wall")
    assert spec(extra_cflags=[""]).key() == spec().key()  # one build for the same flags
    assert spec(extra_ldflags=["-lcudart", "-lc10"]).extra_ldflags == ()
    archs = ["-arch=sm_80", "-gencode arch=compute_90,code=sm_90", "--gpu-architecture sm_89", "-O3"]
    assert spec(extra_cuda_cflags=archs).extra_cuda_cflags == ("-O3",)  # compiled for the verifier's device
    assert spec(extra_cuda_cflags=["-DBLOCK=256", "-U__CUDA_NO_HALF_OPERATORS__"]).extra_cuda_cflags[0] == "-DBLOCK=256"
    for kw, says in [(dict(extra_ldflags=["-lfoo"]), "extra_ldflags may name only libraries every extension links"),
                     (dict(extra_ldflags=["-L/tmp"]), "-lcudart"),
                     (dict(extra_include_paths=["/usr/include"]), "may not add include folders"),
                     (dict(extra_cflags=["-DNS=at"]), "-D macros with a number"),  # a macro renaming a torch API
                     (dict(extra_cuda_cflags=["-Xcompiler=-fopenmp"]), "-Xcompiler"),
                     (dict(extra_cuda_cflags=["-Xcompiler -fplugin=x.so"]), "'-fplugin=x.so'")]:
        with pytest.raises(UnsupportedFormat) as e:
            spec(**kw)
        argument = next(iter(kw))
        assert e.value.argument == argument and argument in str(e.value) and says in str(e.value), str(e.value)
        assert "optimisation" not in str(e.value) or argument != "extra_ldflags"
    with pytest.raises(UnsupportedFormat) as e:  # a vendor library named anywhere is the cheat rule, not a format error
        spec(extra_cuda_cflags=["-O3 -lcublas"])
    assert e.value.rule == "cuda-library"
    vendor = spec_from_call(("e", "int f();", ""), {"extra_cuda_cflags": ["-lcublas"], "extra_ldflags": ["-lcublas"]},
                            allow_vendor_libraries=True)
    assert vendor.extra_ldflags == ("-lcublas",) and vendor.extra_cuda_cflags == ()


def test_load_inline_outside_top_level_and_vendor_libraries():
    src = 'from torch.utils.cpp_extension import load_inline\ndef f():\n    return load_inline(name="e", cpp_sources="")\n'
    with pytest.raises(UnsupportedFormat, match="module top level"):
        extract_specs(src)
    src = 'from torch.utils.cpp_extension import load_inline\ne = load_inline(name="e", cpp_sources="", extra_ldflags=["-lcublas"])\n'
    with pytest.raises(UnsupportedFormat) as e:
        extract_specs(src)
    assert e.value.rule == "cuda-library"


def test_spec_key_is_stable_and_content_only():
    a, = extract_specs(CANDIDATE)
    b, = extract_specs("\n\n" + CANDIDATE.replace("relu_ext = load_inline", "other = load_inline"))
    assert a.key() == b.key() and (a.var, a.line) != (b.var, b.line)
    c, = extract_specs(CANDIDATE.replace("y[i] = x[i] > 0.f", "y[i] = x[i] >= 0.f"))
    assert c.key() != a.key()
    assert a.key() == InlineSpec(**{k: getattr(a, k) for k in ("name", "cpp_sources", "cuda_sources", "functions")}).key()
    # the worker recomputes it from the values the call really receives
    assert inline_spec.spec_from_call((), dict(name="relu_ext", cpp_sources=a.cpp_source, cuda_sources=[a.cuda_source],
                                          functions=list(a.functions), verbose=True)).key() == a.key()


def test_build_key_depends_on_arch_and_toolchain(cache):
    spec = fast_spec()
    b90, b80 = builder(cache), builder(cache, arch="sm_80")
    assert b90.key(spec) == builder(cache).key(spec) and b90.key(spec) != b80.key(spec)
    assert b90.tc.key == b80.tc.key and b90.tc.key != builder(cache, host_opt="-O2").tc.key


# -- launch counters ------------------------------------------------------------------------------
def test_counter_injected_into_every_kernel_and_launch():
    src = r'''
template <typename T> __global__ void __launch_bounds__(256) k1(T* x) { x[0] = T(1); }
extern "C" __global__ void k2(float* x) { if (x) return; }
namespace ns { __global__ void k3(float* x) {} }
__device__ float helper(float v) { return v; }
int host(float* x) {
    k1<float><<<1, 32>>>(x);
    if (x) k2<<<1, 1, 0, 0>>>(x);
    return (int)cudaLaunchKernel((const void*)k2, dim3(1), dim3(1), nullptr, 0, 0);
}
'''
    out = instrument_cuda(src)
    assert out.kernels == ("k1", "k2", "k3") and out.launch_sites == 3 and out.counting == "host"
    assert out.source.count("atomicAdd(&::dice_ray_kernel_runs") == 3 and "helper(float v) { return" in out.source
    # the kernel switch (rule kernel-not-used) in every kernel, after the device counter, on the counter's line
    assert out.source.count("atomicAdd(&::dice_ray_kernel_runs, 1ULL); if (::dice_ray_skip_kernels) return; \n") == 3
    assert "(k1<float><<<1, 32>>>(x), ::dice_ray_launch_done())" in out.source
    assert "::dice_ray_note_launch(cudaLaunchKernel(" in out.source
    macro = instrument_cuda("#define GO(k) k<<<1,1>>>()\n__global__ void k() {}\nvoid h() { GO(k); }\n")
    assert macro.counting == "device" and "macro" in macro.unwrapped[0]


def test_instrumented_source_compiles_and_keeps_line_numbers(cache):
    r = builder(cache).build(fast_spec("lines", FAST_CUDA + r'''
#ifndef NDEBUG
#error "a release build (-DNDEBUG) was expected: device assert() would trap"
#endif
template <int N> __global__ void __launch_bounds__(128) tk(float* y) { y[N] = 2.f; }
extern "C" __global__ void ck(float* y) { if (!y) return; y[0] = 3.f; }
int more() { tk<4><<<1, 1>>>(nullptr); ck<<<1, 1>>>(nullptr); return 0; }
'''))
    assert r.ok, r.log  # cuda.cu with the counters and the kernel switch, main.cpp with their bindings
    assert r.kernels == ("fill", "tk", "ck") and r.counting == "host"
    cuda = FAST_CUDA + "__global__ void bad(float* y) {\n    y[0] = = 1;\n}\n"
    bad = builder(cache).build(fast_spec("err", cuda))
    assert bad.kind == "compile_error" and not bad.ok
    line = cuda.splitlines().index("    y[0] = = 1;") + 1
    assert f"cuda.cu({line}): error" in bad.log, bad.log  # the candidate's own line number
    assert "dice_ray_kernel_runs" not in bad.log  # the injected counter is not shown as the candidate's code
    assert "dice_ray_skip_kernels" not in bad.log
    assert bad.reason().startswith("load_inline build failed (compile error)")


def test_each_linked_extension_is_a_module_of_its_own_name(cache, tmp_path):
    """Candidates with the same cpp_sources share main.o, hence its module name; one process imports a module
    name once (pybind11 3's multi-phase init), so a worker that imported one such extension ran its functions
    for the next candidates too (seen on the H200: a transpose candidate judged by the copy candidate before it).
    The link renames main.o's init function per .so (inline_compile.rename_init_command); here two .so files
    from one main.o, each with its own launch(), import side by side and each runs its own code."""
    import subprocess

    from dice_ray.verify.candidate.toolchain import module_name, rename_init_command

    r = builder(cache).build(fast_spec("names"))
    assert r.ok, r.log
    main_o = r.objects[0]
    syms = subprocess.run(["nm", main_o], capture_output=True, text=True, check=True).stdout
    (shared,) = [line.split()[-1][len("PyInit_"):] for line in syms.splitlines() if " T PyInit_" in line]
    libs = {}
    for v, own in ((1, module_name("1" * 20)), (2, module_name("2" * 20)), (3, shared), (4, shared)):
        (tmp_path / f"f{v}.cpp").write_text(
            f"int launch(int n) {{ return n * {v}; }}\n"
            'extern "C" unsigned long long dice_ray_launches_read() { return 0; }\n'
            'extern "C" unsigned long long dice_ray_kernel_runs_read() { return 0; }\n'
            'extern "C" int dice_ray_skip_kernels_set(int) { return 0; }\n')
        subprocess.run(["g++", "-fPIC", "-c", f"f{v}.cpp", "-o", f"f{v}.o"], cwd=tmp_path, check=True)
        main = main_o
        if own != shared:
            subprocess.run(rename_init_command(main_o, f"m{v}.o", shared, own), cwd=tmp_path, check=True)
            main = f"m{v}.o"
        subprocess.run(["g++", "-shared", main, f"f{v}.o", "-o", f"e{v}.so"], cwd=tmp_path, check=True)
        libs[v] = (own, str(tmp_path / f"e{v}.so"))
    code = f"""
import importlib.util, json
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
print(json.dumps([load(name, path).launch(10) for name, path in {list(libs.values())!r}]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    # renamed: each its own; not renamed (the old link): the second .so of a name gives back the first module
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [10, 20, 30, 30]


# -- the compile pool ------------------------------------------------------------------------------
def _compilers_run(b: InlineBuilder, monkeypatch) -> list[list[str]]:
    """The compiler commands builder ``b`` runs from now on (its ``_run``), recorded."""
    commands: list[list[str]] = []
    real_run = b._run

    def run(cmd, *a, **k):
        commands.append(cmd)
        return real_run(cmd, *a, **k)

    monkeypatch.setattr(b, "_run", run)
    return commands


def test_cache_hit_runs_no_compiler_and_is_shared_across_builders(cache, monkeypatch):
    """A hit is served from the cache, in memory or on disk: no compiler runs for it (its speed is
    benchmarks/inline_build's business, not a unit test's)."""
    b = builder(cache)
    commands = _compilers_run(b, monkeypatch)
    spec = fast_spec("hit")
    cold = b.build(spec)
    assert cold.ok and not cold.cached and len(cold.objects) == 2, cold.log
    compiled = len(commands)  # cuda.cu, and main.cpp unless an earlier spec with the same cpp_sources built main.o
    assert compiled in (1, 2) and any("inline_build.cu" in c for c in commands), commands
    warm = b.build(spec)
    assert warm.ok and warm.cached and warm.key == cold.key and len(commands) == compiled  # the hit compiled nothing
    other = builder(cache)  # a new builder (another step, another process): from disk
    other_commands = _compilers_run(other, monkeypatch)
    again = other.build(spec)
    assert again.cached and again.objects == cold.objects and other_commands == []
    s = b.stats()
    assert s["builds"] == 1 and s["hits"] == 1 and s["cold_s"] > 0 and other.stats()["hits"] == 1


def test_parallel_builds_use_unique_dirs_and_dedupe(cache, monkeypatch):
    b = builder(cache)
    dirs: list[str] = []
    running, peak = [0], [0]
    lock = threading.Lock()
    real_tmp, real_run = b._tmpdir, b._run

    def tmpdir(tag):
        d = real_tmp(tag)
        dirs.append(str(d))
        return d

    def run(*a, **k):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        try:
            return real_run(*a, **k)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(b, "_tmpdir", tmpdir)
    monkeypatch.setattr(b, "_run", run)
    one, two = fast_spec("p1", FAST_CUDA.replace("1.f", "2.f")), fast_spec("p2", FAST_CUDA.replace("1.f", "3.f"))
    futures = [b.submit(one), b.submit(two), b.submit(one)]  # the third joins the first
    results = [f.result() for f in futures]
    assert all(r.ok for r in results) and results[0].key == results[2].key != results[1].key
    assert len(dirs) == len(set(dirs)) >= 2 and peak[0] >= 2  # distinct folders, compilers side by side
    s = b.stats()
    assert s["cuda_compiles"] == 2 and s["waits"] + s["hits"] >= 1
    assert not any(os.path.exists(d) for d in dirs)  # build folders are removed


def test_host_opt_flags_and_a_compiler_crash_on_the_precompiled_header(tmp_path, monkeypatch):
    """main.cpp compiles at the precompiled header's -O level whatever extra_cflags say (g++ 12 crashed, an
    internal compiler error, on -O2/-O3 with the header at -O1); should g++ crash on the header all the same, it
    compiles again without it, and a crash is never cached as the candidate's compile error."""
    b = builder(tmp_path, pch=True)
    commands: list[list[str]] = []
    crash = [True]

    def run(cmd, cwd, file_bytes=None):
        commands.append(cmd)
        if "-include" in cmd and crash[0]:
            return "compile_error", "dice_ray_bindings.cpp:9:1: internal compiler error: Segmentation fault", 0.1
        (Path(cwd) / cmd[cmd.index("-o") + 1]).write_bytes(b"obj")
        return "ok", "", 0.1

    monkeypatch.setattr(b, "_pch", lambda: tmp_path / "dice_torch.h")
    monkeypatch.setattr(b, "_run", run)
    spec = InlineSpec(name="e", cpp_sources=("int f();",), functions=("f",), extra_cflags=("-O3", "-DX=1"))
    r = b.build(spec)
    assert r.ok, r.log
    mains = [c for c in commands if "inline_build.cpp" in c]
    assert len(mains) == 2 and "-include" in mains[0] and "-include" not in mains[1]  # crashed, then without it
    assert all("-O3" not in c and "-DX=1" in c and b.host_opt in c for c in mains)
    assert not list((b.dir / "obj").glob("*.err"))
    crash[0], commands[:] = True, []
    r2 = b.build(InlineSpec(name="e", cpp_sources=("int g();",), functions=("g",)))
    assert r2.ok and len([c for c in commands if "inline_build.cpp" in c]) == 2


def test_compile_bomb_gives_compile_error_within_the_timeout(cache):
    bomb = FAST_CUDA + r'''
template <int N, int K> struct B { static constexpr long v = B<N - 1, 2 * K>::v + B<N - 1, 2 * K + 1>::v; };
template <int K> struct B<0, K> { static constexpr long v = K; };
__global__ void boom(long* o) { o[0] = B<40, 1>::v; }
'''
    b = builder(cache, timeout_s=3.0)
    t0 = time.perf_counter()
    r = b.build(fast_spec("bomb", bomb))
    assert time.perf_counter() - t0 < 20
    assert not r.ok and r.kind in ("timeout", "limit") and ("limit" in r.log or "timeout" in r.reason())


def test_cpu_only_extension_links_and_loads(cache):
    """The .so path (here without CUDA: this machine's torch has no libtorch_cuda): build, link,
    load through exec_inline, call."""
    src = '''
import torch
from torch.utils.cpp_extension import load_inline
ext = load_inline(name="adder", cpp_sources="#include <pybind11/pybind11.h>\\nint add(int a, int b) { return a + b; }",
                  functions=["add"], no_implicit_headers=True)
class ModelNew(torch.nn.Module):
    def forward(self, x):
        return ext.add(2, 3)
'''
    (spec,) = extract_specs(src)
    r = builder(cache, link=True).build(spec)
    assert r.ok and r.path and r.path.endswith(".so"), r.log
    ns = exec_inline(src, {"modules": [r.job_entry(spec)]}, guarded=True)
    assert ns["ModelNew"]()(None) == 5 and inline.launch_count() == 0


# -- worker side without a build ---------------------------------------------------------------------
def test_exec_inline_compile_only_stubs_and_checks():
    (spec,) = extract_specs(CANDIDATE)
    entry = {"key": spec.key(), "module": "m", "path": None, "counting": "host", "has_cuda": True}
    ns = exec_inline(CANDIDATE, {"modules": [entry]}, guarded=True)
    model = ns["ModelNew"]()
    with pytest.raises(NotImplementedError, match="compile-only"):
        model(None)
    real = sys.modules.get("torch.utils.cpp_extension")  # the stand-in is gone after the module ran
    assert real is None or hasattr(real, "BuildExtension")
    from dice_ray.launch import CompileError

    with pytest.raises(CompileError, match="differ from the ones read statically"):
        exec_inline(CANDIDATE, {"modules": [{**entry, "key": "0" * 64}]}, guarded=True)
    from dice_ray.verify.trials.outcome import RuleBroken

    with pytest.raises(RuleBroken, match="import os"):
        exec_inline("import os\n" + CANDIDATE, {"modules": [entry]}, guarded=True)


# -- C++ rules ----------------------------------------------------------------------------------------
def rule_of(cuda_host_body: str, includes: str = "") -> str | None:
    src = CANDIDATE.replace("#include <torch/extension.h>", "#include <torch/extension.h>\n" + includes).replace(
        "    return y;\n}", cuda_host_body + "\n    return y;\n}")
    v = check_candidate(src).first()
    return None if v is None else v.rule


def test_honest_inline_candidate_passes_the_rules():
    report = check_candidate(CANDIDATE)
    assert report.ok, report.violations
    assert report.format == "inline" and report.kernel_refs == {}


@pytest.mark.parametrize("body, includes, rule", [
    ("    y = at::matmul(x, x);", "", "cpp-torch-op"),
    ("    auto s = x.sum();", "", "cpp-torch-op"),
    ("    y = torch::relu(x);", "", "cpp-torch-op"),
    ("    y = y + x;", "", "cpp-torch-op"),
    ("    y.add_(x);", "", "cpp-torch-op"),
    ("    namespace F = torch::nn::functional;\n    y = F::relu(x);", "", "cpp-torch-op"),
    ("    y = conv2d(x, x);", "using namespace torch;", "cpp-torch-op"),
    ("    auto z = torch::zeros({4}, x.options()); auto o = y.view({-1}); int64_t n0 = x.size(0) * 2;", "", None),
    ("    auto h = at::cuda::getCurrentCUDABlasHandle();", "#include <ATen/cuda/CUDAContext.h>", "cuda-library"),
    ("", "#include <cublas_v2.h>", "cuda-library"),
    ("    cudaStream_t s; cudaStreamCreate(&s);", "", "cuda-stream"),
    # memory a kernel writes and the host reads outside torch (a flag that tells forward its kernels ran)
    ("    int h; cudaMemcpy(&h, y.data_ptr(), 4, cudaMemcpyDeviceToHost);", "", "host-memory"),
    # one scalar read back: .cpu().item<T>() is .item<T>() (the run-time layer replays it in the kernel ablation)
    ("    float s = y.cpu().item<float>(); double t = y.cpu().template item<double>(); (void)s; (void)t;", "", None),
    ("    auto s = y.cpu().item(); (void)s;", "", None),
    ("    auto h = y.cpu(); float s = h.item<float>(); (void)s;", "", "cpp-torch-op"),
    ("    float s = y.cpu().data_ptr<float>()[0]; (void)s;", "", "cpp-torch-op"),
    ("    float s = y.cpu().sum().item<float>(); (void)s;", "", "cpp-torch-op"),
    # methods of what metadata calls return (a Device, options) are not Tensor methods
    ("    cudaSetDevice(x.device().index()); auto o = x.options().dtype(torch::kInt); (void)o;", "", None),
    ("    auto d = x.device().index(); y = x.index({0});", "", "cpp-torch-op"),
    ("    int h; cudaMemcpy(&h, y.data_ptr(), 4, (cudaMemcpyKind)2);", "", "host-memory"),
    ("    int h; cudaMemcpyAsync(&h, y.data_ptr(), 4, KIND, 0);", "#define KIND cudaMemcpyDefault", "host-memory"),
    ("    int* f; cudaMallocManaged(&f, 4);", "", "host-memory"),
    ("    int* f; cudaHostAlloc(&f, 4, 0);", "", "host-memory"),
    ("    auto f = torch::zeros({1}, torch::TensorOptions().pinned_memory(true));", "", "host-memory"),
    ("    int h = 0; cudaMemcpyFromSymbol(&h, flag, 4);", "__device__ int flag;", "host-memory"),
    ("", "__managed__ int flag;", "host-memory"),
    ("    int h[2] = {1, 2}; int* d; cudaMalloc(&d, 8); cudaMemcpy(d, h, 8, cudaMemcpyHostToDevice);\n"
     "    cudaMemcpy(d, d, 4, ::cudaMemcpyDeviceToDevice); cudaMemcpyToSymbol(c, h, 8); cudaFree(d);",
     "__constant__ int c[2];", None),
    ("    std::thread t([] {}); t.join();", "#include <thread>", "forbidden-import"),
    ("    std::system(\"ls\");", "#include <cstdlib>", "file-access"),
    ("    auto p = popen(\"ls\", \"r\");", "", "file-access"),
    ("    py::module_::import(\"torch\");", "", "dynamic-code"),
    ("    dice_ray_launches += 1;", "", "patching"),
    # a macro hides what it expands to from the parse tree: its body is checked as host code
    ("    y = RELU(x);", "#define RELU(a) at::relu(a)", "cpp-torch-op"),
    ("    y = CALL(x);", "#define CALL(a) \\\n    a.relu()", "cpp-torch-op"),
    ("    y = RELU(x);", "#define RELU at::relu", "cpp-torch-op"),
    ("    y = NS::relu(x);", "#define NS at", "cpp-torch-op"),
    ("    COUNT += 1;", "#define COUNT dice_ray_launches", "patching"),
    ("", "#define CHECK_CUDA(x) TORCH_CHECK(x.device().is_cuda(), #x \" must be a CUDA tensor\")\n"
         "#define CHECK_INPUT(x) CHECK_CUDA(x); TORCH_CHECK(x.is_contiguous(), #x \" must be contiguous\")\n"
         "#define BLOCK 256\n#define DTYPE at::kFloat\n#define CEIL_DIV(a, b) (((a) + (b) - 1) / (b))\n"
         "#define CUDA_KERNEL_LOOP(i, n) for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < (n); "
         "i += blockDim.x * gridDim.x)", None),
    # a torch op taken as a value (called through a pointer) and a file-scope namespace alias
    ("    auto f = &at::relu; y = f(x);", "", "cpp-torch-op"),
    ("    auto f = at::relu; y = f(x);", "", "cpp-torch-op"),
    ("    y = mine::relu(x);", "namespace mine = at;", "cpp-torch-op"),
    ("    at::Generator gen; auto o = at::TensorOptions().dtype(at::kFloat);", "", None),
    # ATen's dispatcher (an op by schema name, below the Python key) and operator registration
    ('    auto op = c10::Dispatcher::singleton().findSchemaOrThrow("aten::relu", "")'
     '.typed<at::Tensor(const at::Tensor&)>();\n    y = op.call(x);', "", "cpp-torch-op"),
    ("    c10::impl::ExcludeDispatchKeyGuard g(c10::DispatchKey::Python);", "", "cpp-torch-op"),
    ("", 'at::Tensor slow(const at::Tensor& a) { return a; }\nTORCH_LIBRARY_IMPL(aten, CUDA, m) { m.impl("relu", slow); }',
     "patching"),
    # tensor methods and operators the parse tree hid: pointers to members, explicit operator calls,
    # `.template`, reference/lambda/container Tensors
    ("    auto f = &at::Tensor::add_; (y.*f)(x, 1);", "", "cpp-torch-op"),
    ("    y = std::invoke(&at::Tensor::relu, x);", "", "cpp-torch-op"),
    ("    y = x.operator*(x);", "", "cpp-torch-op"),
    ("    y = operator*(x, x);", "", "cpp-torch-op"),
    ("    y = x.template relu();", "", "cpp-torch-op"),
    ("    const auto& xr = x; y = xr * 2;", "", "cpp-torch-op"),
    ("    auto g = [](const torch::Tensor& a) { return a * a; }; y = g(x);", "", "cpp-torch-op"),
    ("    std::vector<torch::Tensor> v{x}; y = v[0] * 2;", "", "cpp-torch-op"),
    # unqualified torch names: argument-dependent lookup finds at::<op> for a Tensor argument, no using needed
    ("    y = relu(x);", "", "cpp-torch-op"),
    ("    y = matmul(x, x);", "", "cpp-torch-op"),
    ("    y = exp(x.view({-1}));", "", "cpp-torch-op"),
    ("    y = relu(x);", "__device__ float relu(float v) { return v > 0.f ? v : 0.f; }", "cpp-torch-op"),
    # the run-time dispatch mode taken off its thread-local stack, or the thread-local state replaced
    ("    auto m = c10::impl::TorchDispatchModeTLS::pop_stack();\n"
     "    c10::impl::TorchDispatchModeTLS::push_non_infra_mode_onto_stack(m);", "", "cpp-torch-op"),
    ("    at::ThreadLocalState s; at::ThreadLocalStateGuard g(s);", "", "cpp-torch-op"),
    ("    c10::impl::DisablePythonDispatcher g;", "", "cpp-torch-op"),
    # names the preprocessor builds or hides (red team, stop 36): token pasting, macros that stand for a torch
    # namespace or build a qualified name from their argument, torch's namespaces reopened, using at::cuda
    ("    y = J(TORCH_LIB, RARY_IMPL);", "#define J(a, b) a##b", "dynamic-code"),
    ("    J(dice_, ray_launches) += 1;", "#define J(a, b) a ## b", "dynamic-code"),
    ("    y = OP(clamp_min)(x, 0);", "#define OP(n) at::cuda::n", "cpp-torch-op"),
    ("    y = NSC::clamp_min(x, 0);", "#define NSC at::cuda", "cpp-torch-op"),
    ("    y = NSC::clamp_min(x, 0);", "#define NSC at::cuda::", "cpp-torch-op"),
    ("    y = at::fwd(x);", "namespace at { inline Tensor fwd(const Tensor& t) { return cuda::clamp_min(t, 0); } }",
     "cpp-torch-op"),
    ("    y = clamp_min(x, 0);", "using namespace at::cuda;", "cpp-torch-op"),
    # files and system calls by other names: a function pointer, inline assembly in host code, an include
    # whose file a macro names, a file-existence probe
    ("    auto op = &fopen; (void)op;", "", "file-access"),
    ('    asm volatile("syscall");', "", "file-access"),
    ("", '#define P "/etc/hostname"\n#include P', "file-access"),
    ("", '#if __has_include("/etc/hostname")\n#endif', "file-access"),
    ("", '%:include "/etc/hostname"', "file-access"),
    # honest host code: C math and std names on numbers, the candidate's own device helpers
    ("    int m = max(n, 4); float e = exp(1.0f); int k = min(m, 3); float r = relu(e); (void)k; (void)r;",
     "__host__ __device__ float relu(float v) { return v > 0.f ? v : 0.f; }", None),
    # honest host code around them
    ("    std::vector<torch::Tensor> outs; outs.push_back(y); auto z = outs[0].view({-1}); int64_t m = outs.size() * 2;"
     "\n    const auto& xc = x.contiguous(); int64_t n2 = xc.numel() * 2; int Library = 3; (void)Library;"
     "\n    auto ptr = [](const torch::Tensor& t) { return t.data_ptr<float>(); }; float* p = ptr(x);",
     "struct P { int a; bool operator<(const P& o) const { return a < o.a; } };", None),
])
def test_cpp_rules(body, includes, rule):
    assert rule_of(body, includes) == rule


def test_decoy_and_unknown_functions_are_caught_statically():
    no_launch = CANDIDATE.replace("relu_kernel<<<(n + 255) / 256, 256>>>(x.contiguous().data_ptr<float>(), "
                                  "y.data_ptr<float>(), n);", "")
    assert check_candidate(no_launch).first().rule == "no-kernel-launch"
    unknown = CANDIDATE.replace("self.ext.relu_cuda(x)", "relu_ext.relu_cuda2(x)")
    v = check_candidate(unknown).first()
    assert v.rule == "unknown-kernel" and v.verdict == "compile_error"
    torch_forward = CANDIDATE.replace("return self.ext.relu_cuda(x)", "return torch.relu(self.ext.relu_cuda(x))")
    assert check_candidate(torch_forward).first().rule == "forward-torch-op"


def test_dice_records_static_verdicts(dice_data):
    records = json.loads((dice_data / "kernel_infilling_evaluation.json").read_text())
    rules = [check_candidate(r["cuda_code"]) for r in records]
    assert all(r.format == "inline" for r in rules)
    firsts = [r.first() for r in rules]
    assert sum(f is None for f in firsts) >= 75  # as observed: 81 pass, 15 cuda-library, 3 torch ops
    assert sum(f is not None and f.rule == "cuda-library" for f in firsts) >= 12


# -- through the Verifier (compile-only) --------------------------------------------------------------
RELU_TASK_REF = """
import torch
import torch.nn as nn
class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)
def get_inputs():
    return [torch.randn(4096)]
def get_init_inputs():
    return []
"""


def test_verifier_verdicts_before_building(tmp_path):
    from dice_ray.config import RewardConfig, VerifyConfig
    from dice_ray.tasks.task import Task
    from dice_ray.verify.verifier import Verifier

    task = Task("test/relu", "relu", 1, RELU_TASK_REF)
    dynamic = CANDIDATE.replace('cuda_sources=source,', 'cuda_sources=source.strip(),')
    cfg = dict(mode="compile_only", compile_timeout_s=30.0, run_timeout_s=10.0, inline_cache_dir=str(tmp_path))
    with Verifier(VerifyConfig(**cfg), RewardConfig()) as v:
        cheat = v.verify(task, CANDIDATE.replace("    return y;\n}", "    y = at::relu(x);\n    return y;\n}"), "c")
        assert cheat.verdict == "cheat" and cheat.rule == "cpp-torch-op" and not cheat.compiled
        bad = v.verify(task, dynamic, "d")
        assert bad.verdict == "compile_error" and "[unsupported-format]" in bad.reason and "cuda_sources" in bad.reason
        fields = v._prepare_inline(dynamic)  # the build step's own check (static_rules=False reaches it)
        assert fields["verdict"] == "compile_error" and fields["rule"] == "unsupported-format"
        assert v._prepare_inline("import torch\n") is None  # the fast format is left alone


@pytest.mark.slow
def test_verifier_compile_only_builds_the_objects(tmp_path):
    """An honest candidate with torch's headers: the objects compile (lite CUDA header), ModelNew
    builds, the dry run stops at the extension (compile-only cannot run it); then a cache hit."""
    from dice_ray.config import RewardConfig, VerifyConfig
    from dice_ray.tasks.task import Task
    from dice_ray.verify.verifier import Verifier

    task = Task("test/relu", "relu", 1, RELU_TASK_REF)
    cfg = VerifyConfig(mode="compile_only", compile_timeout_s=60.0, run_timeout_s=20.0, inline_cache_dir=str(tmp_path),
                       inline_pch=False)
    with Verifier(cfg, RewardConfig(compile_only_reward=0.5)) as v:
        first = v.verify(task, CANDIDATE, "first")
        assert first.verdict == "ok" and first.compiled and "compile-only" in first.reason, first.reason
        second = v.verify(task, CANDIDATE, "second")
        assert second.verdict == "ok" and v._inline_builder.stats()["hits"] == 1
        assert v._inline_builder.stats()["builds"] == 1 and "compile" in second.stage_seconds  # built once, then a hit
        broken = v.verify(task, CANDIDATE.replace("int n = x.numel();", "int n = x.numel()"), "broken")
        assert broken.verdict == "compile_error" and "cuda.cu(" in broken.reason and not broken.compiled


def test_launch_count_sums_the_current_modules_until_reset():
    class Ext:  # what a built extension exports besides the candidate's functions
        def _dice_ray_launches(self):
            return 3

        def _dice_ray_kernel_runs(self):
            return 5

    inline._current[:] = [(Ext(), "host"), (Ext(), "device")]  # a device-counted module reads its device counter
    try:
        assert inline.launch_count() == 3 + 5 and inline.kernel_runs() == 10
        inline.reset()
        assert inline.launch_count() == 0
    finally:
        inline.reset()


def test_kernels_suppressed_sets_the_switch_of_every_module_and_clears_it():
    """The kernel ablation's switch (rule kernel-not-used): set on every current extension inside the block,
    cleared on exit, also when the block raises; an extension that cannot set it raises RuntimeError before
    the block runs, and the ones already set are cleared.  (On a GPU: tests/test_verify_inline_gpu.py.)"""
    class Ext:  # what a built extension exports besides the candidate's functions
        def __init__(self, name, err=0):
            self.__name__, self.err, self.calls = name, err, []

        def _dice_ray_skip_kernels(self, on):
            self.calls.append(on)
            return self.err if on else 0

    a, b = Ext("a"), Ext("b")
    inline._current[:] = [(a, "host"), (b, "device")]
    try:
        with inline.kernels_suppressed():
            assert a.calls == b.calls == [1]
        assert a.calls == b.calls == [1, 0]
        with pytest.raises(ZeroDivisionError), inline.kernels_suppressed():
            1 / 0  # noqa: B018
        assert a.calls == b.calls == [1, 0, 1, 0]
        bad = Ext("bad", err=700)
        inline._current[:] = [(a, "host"), (bad, "host"), (b, "host")]
        ran = []
        with pytest.raises(RuntimeError, match="bad: setting the kernel switch failed"), inline.kernels_suppressed():
            ran.append(1)
        assert not ran and a.calls[-2:] == [1, 0] and bad.calls == [1, 0] and b.calls == [1, 0, 1, 0]
    finally:
        inline.reset()


def test_static_rules_from_many_threads_at_first_use(dice_data):
    """Verifier threads check load_inline candidates concurrently: the first checks in a fresh process
    must not race on the rules' lazily built name tables (once an AssertionError on the H200)."""
    import subprocess

    code = f"""
import json, sys, threading
sys.setswitchinterval(1e-6)
from dice_ray.verify.rules.check import check_candidate
recs = json.load(open({str(dice_data / "kernel_infilling_evaluation.json")!r}))
srcs = [r["cuda_code"] for r in recs[:16]]
errors, results = [], []
def check(src):
    try:
        results.append(check_candidate(src).first())
    except Exception as e:
        errors.append(repr(e))
threads = [threading.Thread(target=check, args=(s,)) for s in srcs]
[t.start() for t in threads]; [t.join() for t in threads]
print(json.dumps({{"errors": errors, "checked": len(results)}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"errors": [], "checked": 16}


def test_a_run_time_load_inline_mismatch_is_a_compile_error_with_its_message():
    """A ``load_inline`` call at run time that differs from the one read statically is the candidate's format
    error (``[unsupported-format]``), reported as a compile error with its message: the harness's line mapping
    reads the error's ``source`` (a CompileError attribute), which the load error lacked (an AttributeError, so a
    ``crash``)."""
    import pickle

    from dice_ray.verify.trials.inline_loader import InlineLoadError, make_loader
    from dice_ray.verify.trials.outcome import error_text, in_candidate_lines

    load_inline = make_loader([])  # nothing was built: every call differs from the static reading
    with pytest.raises(InlineLoadError) as info:
        load_inline(name="ext", cpp_sources="torch::Tensor f(torch::Tensor x);", cuda_sources="", functions=["f"])
    err = info.value
    assert in_candidate_lines(err, "import torch\n") is err
    assert "[unsupported-format]" in error_text(err)
    again = pickle.loads(pickle.dumps(err))
    assert again.source is None and again.log == err.log
