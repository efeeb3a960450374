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

from dice_ray.verify.trials import mismatch_kernel

__all__ = ["Comparison", "compare_outputs", "count_mismatches", "count_mismatches_batch", "fill_could_match",
           "flatten_outputs", "initial_fills", "tolerance"]

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


def initial_fills(dtype: torch.dtype) -> list[Any]:
    """Values an honest output buffer of ``dtype`` is commonly filled with before its kernel writes it:
    0, 1, -1, the dtype's smallest and largest values, and for floating types inf, -inf and NaN (``torch.zeros``,
    ``torch.ones``, ``fill_(-inf)`` for a max, ``fill_(INT_MAX)`` for an argmin; NaN is the verifier's own poison
    of free memory, which an untouched ``torch.empty`` buffer holds)."""
    if dtype == torch.bool:
        return [False, True]
    if dtype.is_complex:
        return [0, 1, -1, complex("nan")]
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    values = [v for v in (0, 1, -1) if info.min <= v <= info.max] + [info.min, info.max]
    return values + [math.inf, -math.inf, math.nan] if dtype.is_floating_point else values


def fill_could_match(obj: Any, *, rtol: float, atol: float, half_rtol: float = 5e-2, half_atol: float = 5e-2) -> bool:
    """Whether buffers filled with one of :func:`initial_fills` (one value a tensor) would match every output
    of ``obj`` under :func:`compare_outputs`' rule and tolerances: an honest candidate whose kernels did
    not run could then return the reference's answer, so the verifier's kernel ablation (rule
    ``kernel-not-used``) says nothing about such a reference output and is skipped.

    All zeros, all NaN, a one-element output that is 0 or 1, ones with noise below the tolerance match;
    a one-element loss of 1.7, or a tensor full of 2.5, does not (no honest buffer starts with that
    value: only a forward that computed it without its kernels returns it).  Numbers, None and empty
    tensors count as matched.

    Args:
        obj: a Tensor or nested tuples/lists of Tensors, numbers and None (a forward's output).
        rtol, atol, half_rtol, half_atol: :func:`compare_outputs`' tolerances.

    Costs one host sync a tensor (its min and max) and a comparison only for a fill value within
    tolerance of both.
    """
    tol = (rtol, atol, half_rtol, half_atol)
    for o in flatten_outputs(obj):
        if not isinstance(o, torch.Tensor) or o.numel() == 0:
            continue
        values = initial_fills(o.dtype)
        if not o.is_complex():
            flat = o.detach().reshape(-1)
            lo, hi = (float(v) for v in torch.stack([flat.min(), flat.max()]).double().tolist())
            if math.isfinite(lo) and math.isfinite(hi):
                r, a = tolerance(o.dtype, rtol, atol, half_rtol, half_atol) if o.is_floating_point() else (0.0, 0.0)
                bound = a + r * max(abs(lo), abs(hi))  # no element's allowed error is larger
                values = [v for v in values if abs(v - lo) <= bound and abs(v - hi) <= bound]
        if not any(_compare_tensor(0, torch.full_like(o, v), o, tol).ok for v in values):
            return False
    return True


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


def _value_masks(out: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float,
                 batched: bool = False) -> tuple[torch.Tensor, ...]:
    """The value rule of both comparisons, on the device without a host sync.

    Args:
        out, ref: same shape and dtype; with ``batched``, ``[B, ...]``: B outputs stacked, each
            compared with its own reference row (its own ``rms``).

    Returns:
        ``(misplaced, bad, err, atol_eff, rms)``: bool masks (ref's shape) of NaN/inf in the wrong
        places and of finite elements with ``|out - ref| > atol_eff + rtol * |ref|``; the absolute
        errors; ``atol_eff = clamp(min(atol, rtol * rms(ref)), min=atol * 1e-4)`` and ``rms(ref)``
        (0-dim, or ``[B, 1, ...]`` when batched; fp32, or fp64 for fp64 references).
    """
    work = torch.float64 if ref.dtype == torch.float64 else torch.float32
    r, o = ref.detach().to(work), out.detach().to(work)
    r_fin, o_fin = torch.isfinite(r), torch.isfinite(o)
    same_nonfinite = (~r_fin) & (~o_fin) & ((r == o) | (torch.isnan(r) & torch.isnan(o)))
    misplaced = (r_fin != o_fin) | ((~r_fin) & ~same_nonfinite)
    rf = torch.where(r_fin, r, 0.0)
    of = torch.where(r_fin, o, 0.0)
    if batched:
        rows = rf.shape[0]
        rms = rf.square().reshape(rows, -1).mean(1).sqrt().reshape(rows, *[1] * (rf.dim() - 1))
    else:
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
        fail (0: the outputs match).  Reading it synchronizes; stack many and read once, or use
        :func:`count_mismatches_batch`.
    """
    counts = count_mismatches_batch([(out, ref)], rtol=rtol, atol=atol, half_rtol=half_rtol, half_atol=half_atol)
    return counts[1] if isinstance(counts, tuple) else counts[0]


#: stacked outputs one batched comparison works on at most (bytes of the outputs, before the fp32 copies)
_BATCH_BYTES = 128 * 2**20


def count_mismatches_batch(
    pairs: list[tuple[Any, Any]], *, rtol: float, atol: float, half_rtol: float = 5e-2, half_atol: float = 5e-2
) -> torch.Tensor | tuple[int, str]:
    """:func:`count_mismatches` of many ``(out, ref)`` pairs in a few kernels, without a host sync.

    Floating CUDA outputs are compared by two fused kernels a pair
    (:mod:`dice_ray.verify.trials.mismatch_kernel`); the others (CPU, integer, complex) are stacked by
    position, shape and dtype (at most ``_BATCH_BYTES`` at a time) and compared row by row, each
    row against its own reference's scale.  Same rule as :func:`compare_outputs`.  The verifier
    checks a candidate's timed outputs this way (``dice_ray.verify.trials.harness``).

    Args:
        pairs: ``[(candidate output, reference output), ...]``, each a Tensor or nested
            tuples/lists of Tensors and numbers.
        rtol, atol, half_rtol, half_atol: as in :func:`compare_outputs`.

    Returns:
        ``(index, reason)`` for the first pair whose structure, shapes, dtypes, devices or
        non-tensor values differ; else a ``[len(pairs)]`` int64 tensor (on the outputs' device,
        CPU when there are no tensors): the failing elements of each pair.
    """
    groups: dict[tuple, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    fused: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    device = None
    for p, (out, ref) in enumerate(pairs):
        outs, refs = flatten_outputs(out), flatten_outputs(ref)
        if len(outs) != len(refs):
            return p, f"forward returned {len(outs)} outputs, the reference {len(refs)}"
        for i, (o, r) in enumerate(zip(outs, refs)):
            if not isinstance(r, torch.Tensor):
                c = compare_outputs(o, r, rtol=rtol, atol=atol, half_rtol=half_rtol, half_atol=half_atol)
                if not c.ok:
                    return p, c.reason
                continue
            if not isinstance(o, torch.Tensor):
                return p, f"output {i}: got {type(o).__name__}, expected a Tensor"
            if tuple(o.shape) != tuple(r.shape) or o.dtype != r.dtype or o.device != r.device:
                return p, (f"output {i}: {tuple(o.shape)} {o.dtype} on {o.device}, "
                           f"expected {tuple(r.shape)} {r.dtype} on {r.device}")
            device = r.device
            if mismatch_kernel.supported(o, r):
                fused.append((p, o, r))
            elif r.numel():
                groups.setdefault((i, tuple(r.shape), r.dtype, r.device), []).append((p, o, r))
    device = fused[0][2].device if fused else device  # the fused kernels add into totals on their GPU
    totals = torch.zeros(len(pairs), dtype=torch.int64, device=device)
    if fused:
        acc = torch.zeros(len(fused), dtype=torch.float64, device=device)
        for k, (p, o, r) in enumerate(fused):
            mismatch_kernel.count_into(o, r, *tolerance(r.dtype, rtol, atol, half_rtol, half_atol), acc[k:], totals[p:])
    for (_, _, dtype, _), members in groups.items():
        first = members[0][2]
        step = max(1, _BATCH_BYTES // max(first.numel() * first.element_size(), 1))
        for c in range(0, len(members), step):
            chunk = members[c: c + step]
            rows = torch.tensor([p for p, _, _ in chunk], device=totals.device)
            o = torch.stack([m[1] for m in chunk])
            r = torch.stack([m[2] for m in chunk])
            if not (dtype.is_floating_point or dtype.is_complex):
                bad = o != r
            else:
                misplaced, bad_mask, _, _, _ = _value_masks(o, r, *tolerance(dtype, rtol, atol, half_rtol, half_atol),
                                                            batched=True)
                bad = misplaced | bad_mask
            totals.index_add_(0, rows, bad.reshape(len(chunk), -1).sum(1).to(totals.device))
    return totals
