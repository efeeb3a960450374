"""dice_ray.launch on CPU: real NVRTC compiles (no GPU needed), PTX parameter table, errors."""

from __future__ import annotations

import math
import re
import struct
import sys
import time

import pytest
import torch

from dice_ray import launch
from dice_ray.verify.candidate import nvrtc

RELU = r"""
extern "C" __global__ void relu_kernel(const float* __restrict__ x, float* __restrict__ y, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] > 0.f ? x[i] : 0.f;
}
struct Pair { float a; int b; };
extern "C" __global__ void mixed(float a, double b, int c, bool d, unsigned char e, Pair p) {}
"""

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the compile-only behaviour")


@pytest.fixture
def dry_run():
    launch.configure(dry_run=True)
    yield
    launch.configure(dry_run=False)


def test_compile_reads_kernels_and_params_from_ptx():
    prog = nvrtc.compile_cuda(RELU, arch="sm_90")
    assert list(prog.kernels) == ["relu_kernel", "mixed"]
    assert [(p.size, p.kind) for p in prog.kernels["relu_kernel"]] == [(8, "int")] * 3
    assert [(p.size, p.kind) for p in prog.kernels["mixed"]] == [
        (4, "float"), (8, "float"), (4, "int"), (1, "int"), (1, "int"), (8, "bytes")
    ]
    assert prog.cubin[:4] == b"\x7fELF" and ".target sm_90" in prog.ptx


def test_compile_cache_by_content_hash():
    src = RELU + "\n// cache probe %f\n" % time.time()
    t0 = time.perf_counter()
    first = nvrtc.compile_cuda(src, arch="sm_90")
    t1 = time.perf_counter()
    second = nvrtc.compile_cuda(src, arch="sm_90")
    t2 = time.perf_counter()
    assert second is first
    assert (t2 - t1) < (t1 - t0) / 10
    assert nvrtc.compile_cuda(src, arch="sm_80") is not first  # the arch is part of the key


def test_device_assert_is_compiled_out():
    """A release build (-DNDEBUG): a failed device assert would trap, which takes 1.1-2.0 s to report
    on an H200 under the verifier's GPU gate (an illegal address ~0.15 s)."""
    prog = nvrtc.compile_cuda('extern "C" __global__ void k(const float* x, float* y) { assert(x[0] < 0.f); y[0] = x[0]; }',
                              arch="sm_90")
    assert "__assertfail" not in prog.ptx and "trap" not in prog.ptx
    assert "NDEBUG" in " ".join(nvrtc.BASE_OPTIONS)


@pytest.mark.parametrize("toolkit", [False, True], ids=["no-toolkit", "toolkit"])
def test_standard_headers_compile_with_their_values(toolkit, monkeypatch):
    """NVRTC has no C library: a kernel's ``#include <cstdint>`` / ``<cmath>`` / ... compiles from the
    launcher's own headers, toolkit or not, and the macros carry the C library's values (read from PTX)."""
    if toolkit and not nvrtc._include_dirs():
        pytest.skip("no CUDA toolkit include folder on this machine")
    monkeypatch.setattr(nvrtc, "_INCLUDES", nvrtc._include_dirs() if toolkit else [])
    includes = "".join(f"#include <{h}>\n" for h in nvrtc.STANDARD_HEADERS)
    src = includes + f"// toolkit={toolkit}\n" + r"""
extern "C" __global__ void k(int64_t* a, std::uint32_t* b, int* c, float* d, double* e, size_t n) {
    assert(n > 0);
    a[0] = INT64_MAX; a[1] = LLONG_MIN; b[0] = UINT32_MAX; c[0] = INT_MAX; c[1] = CHAR_BIT;
    d[0] = FLT_MAX; d[1] = INFINITY; d[2] = NAN; d[3] = FLT_EPSILON; e[0] = DBL_MAX; e[1] = M_PI;
    d[4] = tanhf(d[5]);
}
"""
    ptx = nvrtc.compile_cuda(src, arch="sm_90").ptx
    def f32(x: float) -> int:  # constants are stored as their bit patterns
        return struct.unpack("<i", struct.pack("<f", x))[0]

    def f64(x: float) -> int:
        return struct.unpack("<q", struct.pack("<d", x))[0]

    values = [2**63 - 1, -(2**63), -1, 2**31 - 1, 8,  # UINT32_MAX is -1 as a b32
              f32(3.4028234663852886e38), f32(math.inf), 0x7FFFFFFF, f32(2.0**-23), f64(sys.float_info.max),
              f64(math.pi)]
    for value in values:
        assert re.search(rf"mov\.u(32|64)\s+%\w+, {value};", ptx), value
    assert "__assertfail" not in ptx
    if toolkit:  # CCCL's <cuda/std/...> declare some of the same names: both orders compile
        nvrtc.compile_cuda("#include <cuda/std/cstdint>\n#include <cuda/std/climits>\n" + src, arch="sm_90")
        nvrtc.compile_cuda(src + "#include <cuda/std/cstdint>\n#include <cuda/std/climits>\n", arch="sm_90")


def test_other_host_headers_stay_a_compile_error():
    with pytest.raises(launch.CompileError, match="cannot open source file"):
        nvrtc.compile_cuda('#include <vector>\nextern "C" __global__ void k(float* y) { y[0] = 1.f; }', arch="sm_90")


def test_syntax_error_carries_nvrtc_log():
    with pytest.raises(launch.CompileError) as info:
        nvrtc.compile_cuda('extern "C" __global__ void k(float* x) { x[0] = undefined_name; }', arch="sm_90")
    assert "undefined_name" in info.value.log and "candidate.cu(1)" in info.value.log
    # failures are cached too, and raise the same error again
    with pytest.raises(launch.CompileError):
        nvrtc.compile_cuda('extern "C" __global__ void k(float* x) { x[0] = undefined_name; }', arch="sm_90")


def test_source_without_kernel_is_a_compile_error():
    with pytest.raises(launch.CompileError, match="no __global__ kernel"):
        nvrtc.compile_cuda("__device__ float f(float x) { return x; }", arch="sm_90")
    with pytest.raises(TypeError):
        nvrtc.compile_cuda(b"bytes")  # type: ignore[arg-type]


@no_gpu
def test_compile_only_module_cannot_launch():
    mod = launch.load_cuda(RELU)
    assert not mod.launchable and mod.arch == launch.DEFAULT_ARCH
    assert mod.kernel_names == ["relu_kernel", "mixed"]
    with pytest.raises(RuntimeError, match="no GPU: compile-only"):
        mod.relu_kernel(1, 1, (torch.empty(1), torch.empty(1), 1))
    with pytest.raises(AttributeError, match=r"no kernel 'relu'.*relu_kernel"):
        mod.relu  # noqa: B018


@no_gpu
def test_dry_run_checks_arguments(dry_run):
    mod = launch.load_cuda(RELU)
    before = launch.launch_count()
    mod.relu_kernel((4, 1), 256, (torch.empty(4), torch.empty(4), 4))
    mod.mixed(1, 1, (1.0, 2, 3, True, 255, b"\0" * 8))  # int -> double converts
    assert launch.launch_count() == before + 2
    with pytest.raises(TypeError, match=r"kernel relu_kernel takes 3 parameters, got 2"):
        mod.relu_kernel(1, 1, (torch.empty(1), torch.empty(1)))
    with pytest.raises(TypeError, match=r"kernel relu_kernel parameter 2 .*float"):
        mod.relu_kernel(1, 1, (torch.empty(1), torch.empty(1), 1.5))
    with pytest.raises(TypeError, match=r"kernel mixed parameter 0 .*Tensor"):
        mod.mixed(1, 1, (torch.empty(1), 2.0, 3, True, 1, b"\0" * 8))
    with pytest.raises(TypeError, match=r"kernel mixed parameter 2 .*does not fit"):
        mod.mixed(1, 1, (1.0, 2.0, 1 << 40, True, 1, b"\0" * 8))
    with pytest.raises(TypeError, match=r"kernel mixed parameter 5 .*8"):
        mod.mixed(1, 1, (1.0, 2.0, 3, True, 1, b"\0" * 4))
    with pytest.raises(TypeError, match="unsupported argument type"):
        mod.relu_kernel(1, 1, (torch.empty(1), torch.empty(1), "4"))
    with pytest.raises(ValueError, match="grid"):
        mod.relu_kernel(0, 1, (torch.empty(1), torch.empty(1), 1))
    with pytest.raises(ValueError, match="block"):
        mod.relu_kernel(1, (1, 1, 1, 1), (torch.empty(1), torch.empty(1), 1))
    assert launch.launch_count() == before + 2


@no_gpu
def test_mangled_kernel_found_by_plain_name():
    mod = launch.load_cuda("__global__ void scale(float* x, float a) { x[threadIdx.x] *= a; }")
    assert mod.kernel_names[0].startswith("_Z5scale")
    assert mod.has_kernel("scale") and mod.scale.name == mod.kernel_names[0]


def test_kernels_suppressed_sets_and_restores_the_switch():
    """The verifier's kernel ablation (rule kernel-not-used): the switch Kernel.__call__ reads is set inside
    the block and put back as it was on exit, also when the block raises and when blocks nest.  (Launches
    skipped under it: tests/test_verify_gpu.py::test_launcher_in_process.)"""
    assert launch._suppressed is False
    with launch.kernels_suppressed():
        assert launch._suppressed is True
        with launch.kernels_suppressed():
            assert launch._suppressed is True
        assert launch._suppressed is True  # an inner block leaves the outer one's switch on
    assert launch._suppressed is False
    with pytest.raises(ZeroDivisionError):
        with launch.kernels_suppressed():
            1 / 0  # noqa: B018
    assert launch._suppressed is False
