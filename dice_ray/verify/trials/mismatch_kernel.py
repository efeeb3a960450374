"""The output comparison rule of :mod:`dice_ray.verify.trials.correctness` as two fused CUDA kernels.

The torch form of the rule (``correctness._value_masks``) runs about 25 elementwise kernels over
the output; checking a candidate's timed outputs that way cost about 50 ms a candidate on an
H200, inside the exclusive timing stage.  Here one pass sums the squares of the reference's
finite values (for ``rms(ref)``) and a second counts the failing elements: three reads of the
data instead of about 25.  Same rule, element by element:

* reference finite: fails when the output is not finite or ``|out - ref| > atol_eff + rtol * |ref|``,
  with ``atol_eff = max(min(atol, rtol * rms(ref)), atol * 1e-4)``;
* reference NaN/inf: fails unless the output is the same infinity, or NaN where it is NaN.

Arithmetic is in fp32 (fp64 for fp64 outputs), the sum of squares in fp64.  Built with the
project's own NVRTC launcher (:mod:`dice_ray.launch`); counts are accumulated on the device
(``atomicAdd``), so many comparisons are read with one sync.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["count_into", "supported", "warm"]

_TYPES = {torch.float32: ("f32", "float", "float"), torch.float64: ("f64", "double", "double"),
          torch.float16: ("f16", "__half", "float"), torch.bfloat16: ("bf16", "__nv_bfloat16", "float")}

_TEMPLATE = r"""
extern "C" __global__ void sumsq_{sfx}(const {T}* __restrict__ ref, long long n, double* __restrict__ acc) {{
    double s = 0.0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {{
        {W} v = ({W})ref[i];
        if (isfinite(v)) s += (double)v * (double)v;
    }}
    s = block_sum_d(s);
    if (threadIdx.x == 0) atomicAdd(acc, s);
}}

extern "C" __global__ void count_bad_{sfx}(const {T}* __restrict__ out, const {T}* __restrict__ ref, long long n,
                                          const double* __restrict__ acc, double rtol, double atol,
                                          unsigned long long* __restrict__ bad) {{
    double rms = sqrt(acc[0] / (double)n);
    {W} atol_eff = ({W})fmax(fmin(atol, rtol * rms), atol * 1e-4);
    {W} rt = ({W})rtol;
    unsigned long long c = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {{
        {W} r = ({W})ref[i], o = ({W})out[i];
        bool fails;
        if (isfinite(r)) fails = !isfinite(o) || fabs(o - r) > atol_eff + rt * fabs(r);
        else fails = isfinite(o) || !(o == r || (isnan(o) && isnan(r)));
        c += fails;
    }}
    c = block_sum_u(c);
    if (threadIdx.x == 0 && c) atomicAdd(bad, c);
}}
"""

_SOURCE = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>

__device__ double block_sum_d(double v) {
    __shared__ double part[32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    v = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : 0.0;
    if (threadIdx.x < 32)
        for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    return v;
}

__device__ unsigned long long block_sum_u(unsigned long long v) {
    __shared__ unsigned long long part[32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    v = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : 0ull;
    if (threadIdx.x < 32)
        for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    return v;
}
""" + "".join(_TEMPLATE.format(sfx=s, T=t, W=w) for s, t, w in _TYPES.values())

_BLOCK = 256
_MAX_BLOCKS = 1024


def supported(out: Any, ref: Any) -> bool:
    """Whether :func:`count_into` compares these: CUDA tensors of one float dtype (fp32, fp64, fp16,
    bf16), same shape, at least one element."""
    return (isinstance(out, torch.Tensor) and isinstance(ref, torch.Tensor) and ref.is_cuda and out.is_cuda
            and ref.dtype in _TYPES and out.dtype == ref.dtype and out.shape == ref.shape and ref.numel() > 0)


@functools.cache
def _module(device: int) -> Any:
    from dice_ray import launch

    with torch.cuda.device(device):
        return launch.load_cuda(_SOURCE)


def warm(device: int) -> None:
    """Compile (unless cached) and load the kernels on ``device`` now: a worker does it at start,
    in its CUDA set-up (the gate's ``setup`` stage), so no job pays the NVRTC compile while others wait.

    Raises:
        launch.CompileError: NVRTC failed.
    """
    _module(device)


def count_into(out: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float, acc: torch.Tensor,
               bad: torch.Tensor) -> None:
    """Add the number of elements of ``out`` failing the rule against ``ref`` to ``bad[0]``; no sync.

    Args:
        out, ref: CUDA tensors, same shape and dtype (:func:`supported`); copied when not contiguous.
        rtol, atol: the tolerances for this dtype (``correctness.tolerance``).
        acc: a zeroed float64 CUDA tensor of >= 1 element, used for ``sum(ref**2)``; one a comparison.
        bad: an int64 CUDA tensor of >= 1 element; the count is added to ``bad[0]`` (``atomicAdd``).

    Raises:
        launch.CompileError: NVRTC failed on the kernels (a broken toolkit).
    """
    sfx = _TYPES[ref.dtype][0]
    mod = _module(ref.device.index)
    o, r = out.detach().contiguous(), ref.detach().contiguous()
    n = r.numel()
    grid = min(_MAX_BLOCKS, -(-n // _BLOCK))
    getattr(mod, f"sumsq_{sfx}")(grid=grid, block=_BLOCK, args=(r, n, acc))
    getattr(mod, f"count_bad_{sfx}")(grid=grid, block=_BLOCK, args=(o, r, n, acc, float(rtol), float(atol), bad))
