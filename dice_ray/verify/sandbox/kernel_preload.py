"""Load the CUDA kernels a verifier job uses without running them: a CUDA graph captured and dropped.

Under CUDA's lazy module loading (the default since CUDA 12.2), a kernel's code is loaded into the
context on its first launch.  A fresh worker's first job (its self-test, under the GPU gate) paid
65-210 ms of loading for torch kernels that run in microseconds later, and while it holds the gate
no other worker may time a candidate; a replacement forked after a crash held the gate 237-243 ms
(one H200, stop 19).  Capturing the ops into a CUDA graph makes CUDA resolve (load) each kernel
without executing anything, in the worker's set-up (the gate's ``setup`` stage, shared: a worker starting
beside a timing stage moved its speedups, stop 22) rather than inside a job.  ``CUDA_MODULE_LOADING=EAGER``
loads all of torch instead (3.5 s a worker, measured) and is not used.

The op list follows what :mod:`dice_ray.verify.trials` and :mod:`dice_ray.verify.trials.correctness` run
on every job (input generation, clones and casts, poison fills, finiteness and tolerance masks,
reductions) in the dtypes tasks use; then, in a capture of their own, cuBLAS and cuDNN (a reference's
first ``nn.Linear`` or convolution otherwise creates the library's handle and loads its code under
the gate: 65-287 ms measured on an H200, 0.3-2.6 ms after this).  A kernel missed here is still
loaded on first use: the list changes speed, never a verdict.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

__all__ = ["preload_kernels"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _float_ops(dtype: torch.dtype, n: int, dev: torch.device) -> None:
    """The per-dtype ops of input generation, comparison and timing (nothing here reads back to the host)."""
    x = torch.randn(n, device=dev, dtype=dtype)
    y = torch.rand(n, device=dev, dtype=dtype)
    x.normal_()
    y.uniform_(-1, 1)
    z = x.clone()
    z.copy_(y)
    z.fill_(float("nan"))
    z.zero_()
    w = torch.empty_like(x)
    w.copy_(x.double())
    w.copy_(x.float())
    fin = torch.isfinite(x) & torch.isfinite(y)
    nan = torch.isnan(x) | torch.isnan(y)
    same = (~fin) & ((x == y) | nan)
    rf = torch.where(fin, x, 0.0)
    diff = (rf - y).abs()
    rms = rf.double().pow(2).mean().sqrt()
    tol = torch.clamp(torch.clamp(rms * 1e-2, max=1e-2), min=1e-6)
    bad = (diff.double() > tol) & ~same
    bad.sum()
    bad.reshape(4, -1).sum(1)
    torch.stack([x, y]).sum(0)
    torch.cat([x, y]).amax()
    x.abs().max()
    x.mean()
    x.sum(dtype=torch.float64)
    torch.relu(x)
    (x * y + 1).sqrt()
    fin.all()
    nan.any()


def _library_ops(dtype: torch.dtype, dev: torch.device) -> None:
    """cuBLAS (linear, matmul, batched matmul) and cuDNN (convolutions) in one dtype: their first use
    creates the library's handle and workspace and loads its code, tens of milliseconds."""
    a = torch.randn(64, 64, device=dev, dtype=dtype)
    torch.nn.functional.linear(a, a, a[0])
    a @ a
    torch.bmm(a.reshape(4, 16, 64), a.reshape(4, 64, 16))
    img = torch.randn(2, 4, 8, 8, device=dev, dtype=dtype)
    torch.nn.functional.conv2d(img, torch.randn(4, 4, 3, 3, device=dev, dtype=dtype), padding=1)
    torch.nn.functional.conv1d(img[:, :, 0], torch.randn(4, 4, 3, device=dev, dtype=dtype))


def preload_kernels(device: int, n: int = 1 << 12, between: Callable[[], None] | None = None) -> dict[str, float | int | str]:
    """Capture (never replay) the verifier's common ops on ``device``; returns ``{"ms", "ops"}`` or
    ``{"ms", "error"}`` (a failure is reported, not raised: the kernels then load on first use).

    Lazy loading and its first-launch cost: CUDA C++ Programming Guide, "Lazy Loading"; the capture
    is ``torch.cuda.graph`` in ``relaxed`` mode (loading a module is not a capturable stream op).

    Args:
        device: CUDA device index whose current context gets the kernels.
        n: elements of each captured tensor (1-D, the dtypes above; the graph's memory is freed on return).
        between: called between the two captures (the worker announces its next ``setup`` part there,
            so a timing stage waiting for the GPU gate goes first).

    Returns:
        ``ms``: host wall time of both captures (milliseconds); ``ops``: dtypes whose op set was captured
        (4 floating, 4 integer), or ``error``: the exception that stopped that capture; ``libraries``
        (``"cublas, cudnn"``), or ``libraries_error``: the exception that stopped the libraries' capture.
    """
    dev = torch.device("cuda", device)
    started = time.perf_counter()
    graph = torch.cuda.CUDAGraph()
    ops = 0
    result: dict[str, float | int | str]
    try:
        with torch.cuda.graph(graph, capture_error_mode="relaxed"):
            for dtype in _FLOATS:
                _float_ops(dtype, n, dev)
                ops += 1
            for dtype in (torch.int64, torch.int32, torch.int8, torch.uint8):
                t = torch.randint(0, 100, (n,), device=dev, dtype=dtype)
                ((t != t.clone()).reshape(4, -1).sum(1)).sum()
                t.to(torch.float32)
                ops += 1
            totals = torch.zeros(4, dtype=torch.int64, device=dev)
            totals.index_add_(0, torch.arange(4, device=dev), torch.ones(4, dtype=torch.int64, device=dev))
            torch.ones(1, device=dev) + 1
        result = {"ops": ops}
    except Exception as e:  # noqa: BLE001 - an optimisation: report and go on
        result = {"error": f"{type(e).__name__}: {e}"[:300]}
    finally:
        del graph
    if between is not None:
        between()
    libraries = torch.cuda.CUDAGraph()  # a capture of their own: a library that fails keeps the ops above
    try:
        with torch.cuda.graph(libraries, capture_error_mode="relaxed"):
            for dtype in _FLOATS[:3]:
                _library_ops(dtype, dev)
        result["libraries"] = "cublas, cudnn"
    except Exception as e:  # noqa: BLE001 - likewise
        result["libraries_error"] = f"{type(e).__name__}: {e}"[:300]
    finally:
        del libraries
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()  # the capture stream's cuBLAS workspace (a job's first matmul makes its own)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    return {"ms": round((time.perf_counter() - started) * 1e3, 2), **result}
