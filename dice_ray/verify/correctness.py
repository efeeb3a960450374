"""Output comparison of candidate against reference, closing KernelBench's tolerance gaps.

KernelBench (``eval.py``) compares with ``torch.allclose(out, ref, atol=1e-2, rtol=1e-2)``: an
output whose values are all below ~1e-2 in magnitude passes when the candidate returns zeros.
Here the absolute tolerance is capped by the reference's own scale,
``atol_eff = max(min(atol, rtol * rms(ref)), atol * 1e-4)``, so near-zero outputs are compared
relatively; dtypes must match exactly (no silent precision downgrade); non-finite values must sit
where the reference has them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Comparison", "compare_outputs", "count_mismatches", "flatten_outputs", "tolerance"]

_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Comparison:
    """Result of :func:`compare_outputs`: ``ok`` and a one-line ``reason`` (statistics on failure)."""

    ok: bool
    reason: str


def tolerance(dtype: torch.dtype, rtol: float, atol: float, half_rtol: float, half_atol: float) -> tuple[float, float]:
    """(rtol, atol) for a reference output of ``dtype``: the half pair for fp16/bf16, else the fp32 pair."""
    return (half_rtol, half_atol) if dtype in _HALF else (rtol, atol)


def flatten_outputs(obj: Any) -> list[Any]:
    """Leaves of a forward's output: a Tensor, or nested tuples/lists of Tensors and numbers."""
    if isinstance(obj, (tuple, list)):
        out: list[Any] = []
        for o in obj:
            out.extend(flatten_outputs(o))
        return out
    return [obj]


def _compare_tensor(i: int, out: torch.Tensor, ref: torch.Tensor, tol: tuple[float, float, float, float]) -> Comparison:
    if tuple(out.shape) != tuple(ref.shape):
        return Comparison(False, f"output {i}: shape {tuple(out.shape)}, expected {tuple(ref.shape)}")
    if out.dtype != ref.dtype:
        return Comparison(False, f"output {i}: dtype {out.dtype}, expected {ref.dtype}")
    if out.device != ref.device:
        return Comparison(False, f"output {i}: on {out.device}, expected {ref.device}")
    if not (ref.is_floating_point() or ref.is_complex()):
        if torch.equal(out, ref):
            return Comparison(True, "")
        bad = int((out != ref).sum())
        return Comparison(False, f"output {i}: {bad} of {ref.numel()} integer elements differ")
    if ref.numel() == 0:
        return Comparison(True, "")
    rtol, atol = tolerance(ref.dtype, *tol)
    misplaced_mask, bad_mask, err, atol_eff, rms = _value_masks(out, ref, rtol, atol)
    misplaced = int(misplaced_mask.sum())
    if misplaced:
        return Comparison(False, f"output {i}: {misplaced} of {ref.numel()} elements are NaN/inf where the "
                          "reference is not (or the other way round)")
    n_bad = int(bad_mask.sum())
    if n_bad == 0:
        return Comparison(True, "")
    return Comparison(
        False,
        f"output {i}: {n_bad} of {ref.numel()} elements differ; max abs error {float(err.max()):.3g}, "
        f"atol {float(atol_eff):.3g} (rms(ref) {float(rms):.3g}), rtol {rtol:g}",
    )


def _value_masks(out: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float) -> tuple[torch.Tensor, ...]:
    """The value rule of both comparisons, on the device without a host sync.

    Returns:
        ``(misplaced, bad, err, atol_eff, rms)``: bool masks (ref's shape) of NaN/inf in the wrong
        places and of finite elements with ``|out - ref| > atol_eff + rtol * |ref|``; the absolute
        errors; ``atol_eff = clamp(min(atol, rtol * rms(ref)), min=atol * 1e-4)`` and ``rms(ref)``
        as 0-dim tensors (fp32, or fp64 for fp64 references).
    """
    work = torch.float64 if ref.dtype == torch.float64 else torch.float32
    r, o = ref.detach().to(work), out.detach().to(work)
    r_fin, o_fin = torch.isfinite(r), torch.isfinite(o)
    same_nonfinite = (~r_fin) & (~o_fin) & ((r == o) | (torch.isnan(r) & torch.isnan(o)))
    misplaced = (r_fin != o_fin) | ((~r_fin) & ~same_nonfinite)
    rf = torch.where(r_fin, r, 0.0)
    of = torch.where(r_fin, o, 0.0)
    rms = rf.square().mean().sqrt()
    atol_eff = torch.clamp(torch.clamp(rms * rtol, max=atol), min=atol * 1e-4)
    err = (of - rf).abs()
    return misplaced, err > atol_eff + rtol * rf.abs(), err, atol_eff, rms


def compare_outputs(
    out: Any, ref: Any, *, rtol: float, atol: float, half_rtol: float = 5e-2, half_atol: float = 5e-2
) -> Comparison:
    """Compare a candidate's forward output with the reference's.

    Args:
        out, ref: a Tensor or nested tuples/lists of Tensors and Python numbers (same structure).
        rtol, atol: tolerances for fp32/fp64 outputs (VerifyConfig.rtol / atol; KernelBench 1e-2).
        half_rtol, half_atol: tolerances for fp16/bf16 outputs.

    Returns:
        :class:`Comparison`; ``ok`` only when every leaf matches (shape, dtype, device, non-finite
        positions, and ``|out - ref| <= atol_eff + rtol * |ref|`` element-wise).
    """
    outs, refs = flatten_outputs(out), flatten_outputs(ref)
    if len(outs) != len(refs):
        return Comparison(False, f"forward returned {len(outs)} outputs, the reference {len(refs)}")
    tol = (rtol, atol, half_rtol, half_atol)
    for i, (o, r) in enumerate(zip(outs, refs)):
        if isinstance(r, torch.Tensor):
            if not isinstance(o, torch.Tensor):
                return Comparison(False, f"output {i}: got {type(o).__name__}, expected a Tensor")
            c = _compare_tensor(i, o, r, tol)
            if not c.ok:
                return c
        elif isinstance(r, (int, float, bool)) and not isinstance(o, torch.Tensor):
            if not isinstance(o, (int, float, bool)) or not math.isclose(float(o), float(r), rel_tol=rtol, abs_tol=atol):
                return Comparison(False, f"output {i}: got {o!r}, expected {r!r}")
        elif r is None:
            if o is not None:
                return Comparison(False, f"output {i}: got {type(o).__name__}, expected None")
        else:
            return Comparison(False, f"output {i}: cannot compare a {type(o).__name__} with the reference's "
                              f"{type(r).__name__}")
    return Comparison(True, "")


def count_mismatches(
    out: Any, ref: Any, *, rtol: float, atol: float, half_rtol: float = 5e-2, half_atol: float = 5e-2
) -> torch.Tensor | str:
    """:func:`compare_outputs` without a host sync, for checking many timed calls cheaply.

    Structure, shapes, dtypes and devices are checked on the host (a reason string when they
    differ); the values on the device, with the same rule as :func:`compare_outputs` (non-finite
    positions, ``|out - ref| <= atol_eff + rtol * |ref|``).

    Returns:
        A reason (str), or a 0-dim int64 tensor on the outputs' device: the number of elements that
        fail (0: the outputs match).  Reading it synchronizes; stack many and read once.
    """
    outs, refs = flatten_outputs(out), flatten_outputs(ref)
    if len(outs) != len(refs):
        return f"forward returned {len(outs)} outputs, the reference {len(refs)}"
    total: torch.Tensor | None = None
    for i, (o, r) in enumerate(zip(outs, refs)):
        if not isinstance(r, torch.Tensor):
            c = compare_outputs(o, r, rtol=rtol, atol=atol, half_rtol=half_rtol, half_atol=half_atol)
            if not c.ok:
                return c.reason
            continue
        if not isinstance(o, torch.Tensor):
            return f"output {i}: got {type(o).__name__}, expected a Tensor"
        if tuple(o.shape) != tuple(r.shape) or o.dtype != r.dtype or o.device != r.device:
            return f"output {i}: {tuple(o.shape)} {o.dtype} on {o.device}, expected {tuple(r.shape)} {r.dtype} on {r.device}"
        if not (r.is_floating_point() or r.is_complex()):
            bad = (o != r).sum()
        elif r.numel() == 0:
            continue
        else:
            misplaced, bad_mask, _, _, _ = _value_masks(o, r, *tolerance(r.dtype, rtol, atol, half_rtol, half_atol))
            bad = (misplaced | bad_mask).sum()
        total = bad if total is None else total + bad
    return total if total is not None else torch.zeros((), dtype=torch.int64)
