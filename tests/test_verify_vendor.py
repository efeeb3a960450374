"""``verify.allow_vendor_libraries`` (issue 3): cuBLAS / cuDNN & co. in load_inline candidates are
the cheat rule ``cuda-library`` by default and accepted when the config allows them; the launch
rule (the candidate's own kernel on every call) and the closed list of ``-l`` flags stay."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest

from dice_ray.verify.candidate.inline_build import InlineBuilder
from dice_ray.verify.candidate.inline_spec import VENDOR_LIBRARIES, InlineSpec, UnsupportedFormat, extract_specs
from dice_ray.verify.rules.catalog import RULES
from dice_ray.verify.rules.check import check_candidate
from dice_ray.verify.trials.execution import exec_inline

#: a hand-written candidate: cuBLAS does the GEMM, the candidate's own kernel adds the bias
CUBLAS_CANDIDATE = r'''
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cuda_src = r"""
#include <torch/extension.h>
#include <cublas_v2.h>
#include <ATen/cuda/CUDAContext.h>

__global__ void add_bias(float* y, const float* b, int rows, int cols) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < rows * cols) y[i] += b[i % cols];
}

torch::Tensor linear_cuda(torch::Tensor x, torch::Tensor w, torch::Tensor b) {
    int m = x.size(0), k = x.size(1), n = w.size(0);
    auto y = torch::empty({m, n}, x.options());
    float alpha = 1.f, beta = 0.f;
    cublasHandle_t h = at::cuda::getCurrentCUDABlasHandle();
    cublasSgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &alpha, w.data_ptr<float>(), k, x.data_ptr<float>(), k,
                &beta, y.data_ptr<float>(), n);
    add_bias<<<(m * n + 255) / 256, 256>>>(y.data_ptr<float>(), b.data_ptr<float>(), m, n);
    return y;
}
"""

linear_ext = load_inline(name="linear_ext", cpp_sources="torch::Tensor linear_cuda(torch::Tensor x, torch::Tensor w, "
                         "torch::Tensor b);", cuda_sources=cuda_src, functions=["linear_cuda"]LDFLAGS)


class ModelNew(nn.Module):
    def __init__(self, k, n):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n, k))
        self.b = nn.Parameter(torch.randn(n))

    def forward(self, x):
        return linear_ext.linear_cuda(x, self.w, self.b)
'''


def candidate(ldflags: str = "") -> str:
    return CUBLAS_CANDIDATE.replace("LDFLAGS", f", extra_ldflags={ldflags}" if ldflags else "")


def first_rule(src: str, allow: bool) -> str | None:
    v = check_candidate(src, allow_vendor_libraries=allow).first()
    return None if v is None else v.rule


# -- static rules -----------------------------------------------------------------------------------
def test_cublas_candidate_is_a_cheat_by_default_and_passes_when_allowed():
    src = candidate()
    v = check_candidate(src).first()
    assert v is not None and v.rule == "cuda-library" and v.verdict == "cheat"
    report = check_candidate(src, allow_vendor_libraries=True)
    assert report.ok, report.violations
    assert report.format == "inline"


@pytest.mark.parametrize("edit, rule", [
    # cuBLAS alone: the candidate's own kernel is never launched (the launch rule stays)
    (lambda s: s.replace("    add_bias<<<(m * n + 255) / 256, 256>>>(y.data_ptr<float>(), b.data_ptr<float>(), m, n);\n",
                         ""), "no-kernel-launch"),
    # torch's own compute is still a fallback, vendor libraries or not
    (lambda s: s.replace("    return y;\n}", "    y = at::matmul(x, w.t());\n    return y;\n}"), "cpp-torch-op"),
    # communication libraries are not math libraries
    (lambda s: s.replace("#include <cublas_v2.h>", "#include <cublas_v2.h>\n#include <nccl.h>"), "cuda-library"),
    # streams stay refused
    (lambda s: s.replace("    return y;\n}", "    cudaStream_t st; cudaStreamCreate(&st);\n    return y;\n}"),
     "cuda-stream"),
])
def test_other_rules_hold_with_vendor_libraries_allowed(edit, rule):
    assert first_rule(edit(candidate()), allow=True) == rule


def test_fast_format_keeps_the_rule():
    """NVRTC compiles device code only: the fast format cannot call host libraries."""
    fast = '''
import torch
import torch.nn as nn
from dice_ray.launch import load_cuda
src = r"""
#include <cublas_v2.h>
extern "C" __global__ void k(float* y) { y[0] = 1.f; }
"""
kernels = load_cuda(src)
class ModelNew(nn.Module):
    def forward(self, x):
        y = torch.empty_like(x)
        kernels.k(grid=(1,), block=(1,), args=(y,))
        return y
'''
    assert first_rule(fast, allow=True) == "cuda-library"
    assert first_rule(fast.replace("#include <cublas_v2.h>\n", ""), allow=True) is None


def test_dice_infilling_references_with_vendor_libraries(dice_data):
    """DICE record 4383 calls cublasLtMatmul through torch's cuBLASLt handle: a cheat by default,
    clean with vendor libraries allowed, and its build links cublas and cublasLt."""
    records = {r["id"]: r for r in json.loads((dice_data / "kernel_infilling_evaluation.json").read_text())}
    src = records[4383]["cuda_code"]
    assert first_rule(src, allow=False) == "cuda-library"
    assert first_rule(src, allow=True) is None
    (spec,) = extract_specs(src, allow_vendor_libraries=True)
    assert spec.vendor_libraries() == ("cublas", "cublasLt")
    assert first_rule(records[7678]["cuda_code"], allow=True) == "cpp-torch-op"  # cuDNN, but also x.clone()


# -- extra_ldflags: the closed list -------------------------------------------------------------------
def test_ldflags_vendor_only_when_allowed_and_never_others():
    with pytest.raises(UnsupportedFormat, match="allow_vendor_libraries") as e:
        extract_specs(candidate('["-lcublas"]'))
    assert e.value.rule == "cuda-library"
    assert first_rule(candidate('["-lcublas"]'), allow=False) == "cuda-library"
    (spec,) = extract_specs(candidate('["-lcublas", "-lcublasLt"]'), allow_vendor_libraries=True)
    assert spec.extra_ldflags == ("-lcublas", "-lcublasLt")
    assert first_rule(candidate('["-lcublas"]'), allow=True) is None
    for flag, rule in [("-lfoo", "unsupported-format"), ("-L/tmp", "unsupported-format"),
                       ("-lnccl", "cuda-library"), ("-lcublas_static", "cuda-library")]:
        for allow in (False, True):
            with pytest.raises(UnsupportedFormat) as e:
                extract_specs(candidate(f'["{flag}"]'), allow_vendor_libraries=allow)
            assert e.value.rule == rule, (flag, allow)
            report = check_candidate(candidate(f'["{flag}"]'), allow_vendor_libraries=allow)
            assert rule in {v.rule for v in report.violations}
            # without vendor libraries the sources' cuBLAS calls are the cheat that decides
            assert report.first().rule == (rule if allow else "cuda-library"), (flag, allow)


def test_vendor_libraries_found_in_the_sources():
    def spec(cuda: str, ldflags: tuple[str, ...] = ()) -> InlineSpec:
        return InlineSpec(name="e", cpp_sources=("int f();",), cuda_sources=(cuda,), extra_ldflags=ldflags)

    assert spec("__global__ void k() {}").vendor_libraries() == ()
    assert spec("#include <cudnn.h>\ncudnnHandle_t h;").vendor_libraries() == ("cudnn",)
    assert spec("auto h = at::cuda::getCurrentCUDABlasLtHandle();").vendor_libraries() == ("cublas", "cublasLt")
    assert spec("#include <curand_kernel.h>\ncurand_init(1, 0, 0, &s);").vendor_libraries() == ()  # header-only
    assert spec("curandCreateGenerator(&g, CURAND_RNG_PSEUDO_DEFAULT);").vendor_libraries() == ("curand",)
    assert spec("", ("-lcufft",)).vendor_libraries() == ("cufft",)
    assert set(VENDOR_LIBRARIES) == {"cublas", "cublasLt", "cudnn", "cusparse", "cufft", "cusolver", "curand"}


def test_spec_keys_without_ldflags_are_unchanged():
    """Specs without vendor flags hash as before the field existed (the worker matches run-time calls
    by this key); a vendor flag changes the key."""
    (spec,) = extract_specs(candidate())
    d = dataclasses.asdict(spec)
    for k in ("var", "line", "extra_ldflags"):
        d.pop(k)
    assert spec.key() == hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()
    (linked,) = extract_specs(candidate('["-lcublas"]'), allow_vendor_libraries=True)
    assert linked.key() != spec.key()


def test_the_setting_reaches_the_worker_side_loader():
    """The worker reads the run-time load_inline call again: with the job's flag it accepts -lcublas,
    without it the call is refused (as statically)."""
    src = candidate('["-lcublas"]')
    (spec,) = extract_specs(src, allow_vendor_libraries=True)
    entry = {"key": spec.key(), "module": "m", "path": None, "counting": "host", "has_cuda": True}
    ns = exec_inline(src, {"modules": [entry], "allow_vendor_libraries": True}, guarded=True)
    with pytest.raises(NotImplementedError, match="compile-only"):
        ns["ModelNew"](4, 8)(None)
    from dice_ray.launch import CompileError

    with pytest.raises(CompileError, match="cuda-library"):
        exec_inline(src, {"modules": [entry]}, guarded=True)


# -- link flags ----------------------------------------------------------------------------------------
def test_link_flags_of_vendor_libraries(tmp_path, monkeypatch):
    libdir = tmp_path / "lib"
    libdir.mkdir()
    for name in ("libcublas.so.11", "libcublas.so.12", "libcublasLt.so.12"):
        (libdir / name).write_bytes(b"")
    (spec,) = extract_specs(candidate('["-lcublas", "-lcudnn"]'), allow_vendor_libraries=True)
    assert spec.vendor_libraries() == ("cublas", "cublasLt", "cudnn")
    b = InlineBuilder(tmp_path / "cache", link=True, link_vendor_libraries=True, pch=False)
    b.tc = dataclasses.replace(b.tc, lib_dirs=(str(libdir),))
    with monkeypatch.context() as m:
        m.setattr("importlib.util.find_spec", lambda name, *a: None)  # no nvidia-* wheels here
        args = b.vendor_link_args(spec)
    assert args == [f"-L{libdir}", f"-Wl,-rpath,{libdir}", "-l:libcublas.so.12",
                    f"-L{libdir}", f"-Wl,-rpath,{libdir}", "-l:libcublasLt.so.12",
                    "-lcudnn"]  # asked for, not found: the linker reports it
    seen: list[list[str]] = []

    def fake_run(cmd, cwd, file_bytes=None):
        seen.append(cmd)
        (Path(cwd) / "ext.so").write_bytes(b"")
        return "ok", "", 0.0

    monkeypatch.setattr(b, "_run", fake_run)
    assert b._link(("main.o", "cuda.o"), tmp_path / "x.so", args).ok
    assert seen[0][-len(args):] == args and "-ltorch_cuda" in seen[0]
    off = InlineBuilder(tmp_path / "cache", link=True, pch=False)  # the default: never linked
    assert off.vendor_link_args(spec) == [] and off.key(spec) != b.key(spec)
    compile_only = InlineBuilder(tmp_path / "cache", link=False, link_vendor_libraries=True, pch=False)
    assert compile_only.vendor_link_args(spec) == []
    b.close(), off.close(), compile_only.close()


# -- config and the Verifier ------------------------------------------------------------------------------
def test_config_field_is_documented():
    from dice_ray.config import VerifyConfig

    field = VerifyConfig.model_fields["allow_vendor_libraries"]
    assert field.default is False and VerifyConfig().allow_vendor_libraries is False
    text = field.description
    for words in ("cuda-library", "-lcublas", "vendor library, not the model's kernel", "no-kernel-launch",
                  "own extension", "NVRTC"):
        assert words in text, words
    assert "allow_vendor_libraries" in RULES["cuda-library"].description


RELU_REF = """
import torch
import torch.nn as nn
class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)
def get_inputs():
    return [torch.randn(64)]
def get_init_inputs():
    return []
"""

#: a small cuBLAS candidate: its CUDA file needs no torch header (one quick nvcc run, lite headers)
SMALL = r'''
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline
cuda_src = r"""
#include <cublas_v2.h>
__global__ void fill(float* y, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] = 0.f; }
int run(int n) {
    cublasHandle_t h; cublasCreate(&h);
    float* y = nullptr; fill<<<1, 32>>>(y, n);
    cublasDestroy(h);
    return n;
}
"""
ext = load_inline(name="small_blas", cpp_sources="int run(int n);", cuda_sources=cuda_src, functions=["run"],
                  extra_ldflags=["-lcublas"])
class ModelNew(nn.Module):
    def forward(self, x):
        ext.run(4)
        return x
'''


def test_verifier_verdicts_default_and_allowed(tmp_path):
    from dice_ray.config import RewardConfig, VerifyConfig
    from dice_ray.tasks.task import Task
    from dice_ray.verify.verifier import Verifier

    task = Task("test/relu", "relu", 1, RELU_REF)
    cfg = {"mode": "compile_only", "compile_timeout_s": 30.0, "run_timeout_s": 10.0, "inline_cache_dir": str(tmp_path),
           "fork_server": False, "spare_workers": 0, "inline_pch": False}
    with Verifier(VerifyConfig(**cfg), RewardConfig()) as v:
        for src in (SMALL, candidate()):
            cheat = v.verify(task, src, "c")
            assert cheat.verdict == "cheat" and cheat.rule == "cuda-library" and not cheat.compiled, cheat.reason
        assert v._prepare_inline(SMALL)["rule"] == "cuda-library"  # the build step's own check of -lcublas
        with Verifier(VerifyConfig(**cfg, allow_vendor_libraries=True), RewardConfig()) as allowed:
            got = allowed.verify(task, SMALL, "a")
    # ok where the CUDA toolkit has cuBLAS headers; a compile error naming the header where it has not
    assert got.verdict in ("ok", "compile_error") and got.rule is None, got.reason
    assert "cuda-library" not in got.reason
    if got.verdict == "compile_error":
        assert "cublas_v2.h" in got.reason, got.reason
