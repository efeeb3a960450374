"""What the verifier learns once about a task's reference, and reuses for every later candidate of it.

Every candidate of a task is checked against the same reference on the same seeded trial-0 inputs, so
two results are the same for all of them: that the reference is deterministic and finite there (two
runs agree), and how far its fp32 outputs are from a float64 run of it.  A worker measures them in
the first job of a reference (:func:`measure`, in the shared ``reference`` stage, before the
candidate's model is built) and returns them; the :class:`~dice_ray.verify.verifier.Verifier` passes
them with every later job of that reference, which then runs the reference once instead of twice and
skips the float64 run whenever a bound proves the candidate's precision (:func:`error_bound`).
In RL a task's group of candidates shares one reference, and tasks come back every epoch.

The precision rule (``VerifyConfig.precision_rtol``; see :mod:`dice_ray.verify.trials.precision`): an fp32
output's relative RMS error against float64, ``e_cand = ||o - g|| / ||g||`` (RMS norms over the
elements finite in both ``g`` and the reference output ``r``), may not exceed ``max(precision_rtol,
10 e_ref)`` with ``e_ref = ||r - g|| / ||g||``.  By the triangle inequality ``e_cand <= ||o - r|| /
||g|| + e_ref``: the fp32 difference to the reference plus the stored ``e_ref`` bounds it without
``g``.  An honest fp32 candidate (``||o - r||`` at rounding level) passes on the bound; one computed in
fp16, bf16 or TF32 does not, and gets the exact check with a float64 run, as before.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from dice_ray.verify.trials.correctness import flatten_outputs

__all__ = ["OutputPrecision", "ReferenceFacts", "error_bound", "float64_outputs", "measure", "relative_rms"]


@dataclass
class OutputPrecision:
    """One fp32 output of the reference against a float64 run of it (trial-0 inputs).

    Attributes:
        index: the output's position in :func:`~dice_ray.verify.trials.correctness.flatten_outputs`.
        scale: RMS of the float64 output over the elements finite in both runs (0: all zero, not checked).
        ref_error: the fp32 output's relative RMS error against it (dimensionless).
    """

    index: int
    scale: float
    ref_error: float


@dataclass
class ReferenceFacts:
    """The reference's facts on trial 0 (see the module docstring); ``to_dict`` / ``from_dict`` carry them as JSON.

    Attributes:
        outputs: the fp32 outputs' :class:`OutputPrecision` (empty: none, or the precision check is off).
        note: why the precision check cannot run ("" when it can), e.g. the reference does not run in float64.
    """

    outputs: list[OutputPrecision] = field(default_factory=list)
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The facts as a JSON-ready dict (:meth:`from_dict` reads it back)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ReferenceFacts:
        """Raises: TypeError, KeyError: ``d`` is not what :meth:`to_dict` wrote."""
        return cls([OutputPrecision(**o) for o in d["outputs"]], str(d["note"]))


def float64_outputs(ref_model: torch.nn.Module, inputs: list[Any]) -> list[Any]:
    """The reference's flattened outputs run in float64: a deep copy of ``ref_model`` in double, its
    floating inputs cast to double (others cloned).  Raises whatever the forward raises."""
    with torch.no_grad():
        model64 = copy.deepcopy(ref_model).double()
        out = flatten_outputs(model64(*[x.double() if isinstance(x, torch.Tensor) and x.is_floating_point()
                                        else x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]))
    del model64
    return out


def relative_rms(a: torch.Tensor, b: torch.Tensor, scale: float, mask: torch.Tensor | None = None) -> float:
    """``RMS(a - b) / scale`` in float64 (``mask``: elements outside count as 0; ``scale`` > 0); inf or NaN
    when ``a`` has non-finite values."""
    d = a.double() - b.double()
    if mask is not None:
        d = torch.where(mask, d, 0.0)
    return float(d.square().mean().sqrt()) / scale


def measure(ref_model: torch.nn.Module, inputs: list[Any], expected: Any, precision_rtol: float) -> ReferenceFacts:
    """The precision facts of a reference whose output on ``inputs`` is ``expected`` (already checked
    deterministic and finite): a float64 run when ``precision_rtol`` > 0 and it has fp32 outputs.

    Args:
        ref_model: the reference module (fp32 parameters; copied, not changed).
        inputs: trial 0's pristine inputs.
        expected: its output on them.
        precision_rtol: ``VerifyConfig.precision_rtol`` (0: the check is off, no float64 run).
    """
    refs = flatten_outputs(expected)
    if precision_rtol <= 0 or not any(isinstance(r, torch.Tensor) and r.dtype == torch.float32 for r in refs):
        return ReferenceFacts()
    try:
        gt = float64_outputs(ref_model, inputs)
    except Exception as e:  # noqa: BLE001
        return ReferenceFacts(note=f"precision check skipped (the reference does not run in float64: {type(e).__name__})")
    outputs = []
    for i, (r, g) in enumerate(zip(refs, gt)):
        if not (isinstance(r, torch.Tensor) and r.dtype == torch.float32 and isinstance(g, torch.Tensor)):
            continue
        fin = torch.isfinite(g) & torch.isfinite(r)
        scale = float(torch.where(fin, g.double(), 0.0).square().mean().sqrt())
        outputs.append(OutputPrecision(i, scale, relative_rms(r, g, scale, fin) if scale > 0 else 0.0))
    return ReferenceFacts(outputs)


def error_bound(out: torch.Tensor, ref: torch.Tensor, p: OutputPrecision) -> float:
    """An upper bound on a candidate output's relative RMS error against float64 without a float64
    run: ``RMS(out - ref) / p.scale + p.ref_error`` (the triangle inequality; ``ref`` the fp32
    reference output the facts were measured with).  inf or NaN when ``out`` has non-finite values
    (no bound: the caller runs the exact check)."""
    return relative_rms(out, ref, p.scale) + p.ref_error
