"""The process-wide torch settings a job may change, saved at the worker's start and restored around each job.

A candidate's module (or its load_inline C++, through ``at::globalContext()``) can flip TF32, cuDNN's
benchmark mode, the default dtype or the attention back-ends, which would change what the reference computes
or how fast it runs.  The harness saves them once (:func:`save`) and puts them back before the reference runs
and after every job (:func:`restore`).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["restore", "save"]

#: torch's scaled-dot-product-attention backends (``torch.backends.cuda.<k>_sdp_enabled``), restored after each job
_SDP_BACKENDS = ("flash", "mem_efficient", "math", "cudnn")


def save() -> dict[str, Any]:
    """The current settings (default dtype, matmul precision, TF32, cuDNN, reduced-precision reductions, SDP
    back-ends, grad mode, deterministic algorithms) as a dict for :func:`restore`."""
    return {
        "dtype": torch.get_default_dtype(),
        "matmul_precision": torch.get_float32_matmul_precision(),
        "tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,
        "cudnn_bench": torch.backends.cudnn.benchmark,
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "grad": torch.is_grad_enabled(),
        # what a load_inline candidate's C++ can flip (at::globalContext()) to slow the reference down
        "cudnn": torch.backends.cudnn.enabled,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "fp16_reduction": torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
        "bf16_reduction": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "sdp": {k: getattr(torch.backends.cuda, f"{k}_sdp_enabled")() for k in _SDP_BACKENDS},
    }


def restore(s: dict[str, Any]) -> None:
    """Put back the settings :func:`save` returned."""
    torch.set_default_dtype(s["dtype"])
    torch.set_float32_matmul_precision(s["matmul_precision"])
    torch.backends.cuda.matmul.allow_tf32 = s["tf32"]
    torch.backends.cudnn.allow_tf32 = s["cudnn_tf32"]
    torch.backends.cudnn.benchmark = s["cudnn_bench"]
    torch.use_deterministic_algorithms(s["deterministic"])
    torch.set_grad_enabled(s["grad"])
    torch.backends.cudnn.enabled = s["cudnn"]
    torch.backends.cudnn.deterministic = s["cudnn_deterministic"]
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = s["fp16_reduction"]
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = s["bf16_reduction"]
    for k, on in s["sdp"].items():
        getattr(torch.backends.cuda, f"enable_{k}_sdp")(on)
