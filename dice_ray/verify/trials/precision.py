"""The precision check, rule ``precision-downgrade``: fp32 outputs as accurate as fp32 math.

Computing an fp32 task in fp16/bf16/TF32 passes allclose at 1e-2; the candidate's relative RMS error against a
float64 run of the reference may not exceed ``max(precision_rtol, 10 x the fp32 reference's own)``.  The
reference's facts (:mod:`dice_ray.verify.trials.reference_facts`) bound the error without a float64 run where
they can.
"""

from __future__ import annotations

from typing import Any

import torch

from dice_ray.verify.trials import reference_facts
from dice_ray.verify.trials.correctness import flatten_outputs
from dice_ray.verify.trials.outcome import RuleBroken
from dice_ray.verify.trials.reference_facts import ReferenceFacts

__all__ = ["PrecisionCheck"]


class PrecisionCheck:
    """The precision check of a job (trial 0), a part of :class:`~dice_ray.verify.trials.harness.Harness`.

    Reads the harness's ``settings`` (``precision_rtol``).
    """

    def _check_precision(self, ref_model: Any, inputs: list[Any], expected: Any, out: Any,
                         facts: ReferenceFacts) -> str:
        """Compare fp32 outputs with a float64 run of the reference (``precision_rtol``).

        The candidate's relative RMS error may not exceed ``max(precision_rtol, 10 x the fp32
        reference's own)``: computing an fp32 task in fp16/bf16/TF32 passes allclose at 1e-2 but
        fails here.  ``facts`` (:mod:`~dice_ray.verify.trials.reference_facts`: the reference's own error and
        the float64 output's scale on these inputs) bound the error without a float64 run; an output
        the bound cannot clear gets the exact check, with one.  Returns a note; the check is skipped
        (noted) when the reference has no fp32 outputs or does not run in float64.

        Raises:
            RuleBroken: ``precision-downgrade``.
        """
        bound = float(self.settings.get("precision_rtol", 0.0))
        if bound <= 0 or facts.note or not facts.outputs:
            return facts.note if bound > 0 else ""
        outs, refs = flatten_outputs(out), flatten_outputs(expected)
        worst, exact = 0.0, []
        for p in facts.outputs:
            limit = max(bound, 10.0 * p.ref_error)
            if p.scale == 0.0:
                continue
            upper = reference_facts.error_bound(outs[p.index], refs[p.index], p)
            if upper <= limit:
                worst = max(worst, upper)
            else:
                exact.append((p, limit))
        if exact:
            try:
                gt = reference_facts.float64_outputs(ref_model, inputs)
            except Exception as e:  # noqa: BLE001
                return f"precision check skipped (the reference does not run in float64: {type(e).__name__})"
            for p, limit in exact:
                o, r, g = outs[p.index], refs[p.index], gt[p.index]
                e_cand = reference_facts.relative_rms(o, g, p.scale, torch.isfinite(g) & torch.isfinite(r))
                if e_cand > limit:
                    raise RuleBroken("precision-downgrade",
                                     f"output {p.index}: relative RMS error {e_cand:.2e} against a float64 run of the "
                                     f"reference; the fp32 reference's own is {p.ref_error:.2e}, the bound "
                                     f"max({bound:g}, 10x that) = {limit:.2e}")
                worst = max(worst, e_cand)
        return f"fp32 error vs float64 {'at most ' if not exact else ''}{worst:.1e}"
