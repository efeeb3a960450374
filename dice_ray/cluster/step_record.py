"""A finished RL step as figures: the rates of its verdicts and the record ``metrics.jsonl`` keeps (one JSON line a
step; the phase scheduler's gate and ``dice-ray report`` read it)."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict

from dice_ray.cluster.rollout import GroupRollout
from dice_ray.cluster.scheduler import StepPlan


def correct_rate(verdicts: list) -> float | None:
    """Share of the verdicts whose correctness a GPU verifier measured that matched the reference; None when
    none was measured.  A compile-only verifier measures no correctness: its dry run can still call a wrong
    output shape ``incorrect``, but one such verdict among unmeasured ``ok`` ones is no correct rate of 0 %."""
    measured = [v for v in verdicts if v.correct is not None and v.mode != "compile_only"]
    return sum(bool(v.correct) for v in measured) / len(measured) if measured else None


def speedup_geomean(verdicts: list) -> float | None:
    """Geometric mean of the measured speedups of the correct verdicts; None when there is none."""
    speedups = [v.speedup for v in verdicts if v.correct and v.speedup and v.speedup > 0]
    return math.exp(statistics.fmean(math.log(s) for s in speedups)) if speedups else None


def rates(verdicts: list) -> dict:
    """``candidates``, ``reward_mean``, ``compile_rate`` (the module built: its kernels may still miss what the launch
    code calls), ``ok_rate`` (verdict ``ok``: what a compile-only verifier rewards), ``correct_rate``
    (:func:`correct_rate`) and ``speedup_geomean`` (:func:`speedup_geomean`) of verdicts."""
    n = max(len(verdicts), 1)
    return {"candidates": len(verdicts), "reward_mean": sum(v.reward for v in verdicts) / n,
            "compile_rate": sum(v.compiled for v in verdicts) / n,
            "ok_rate": sum(v.verdict == "ok" for v in verdicts) / n, "correct_rate": correct_rate(verdicts),
            "speedup_geomean": speedup_geomean(verdicts)}


def by_phase(groups: list[GroupRollout], verdicts: list) -> dict:
    """Figures of each phase's prompts in a step: ``{phase: {"prompts", "candidates", "reward_mean", "compile_rate",
    "correct_rate"}}`` for the phases the step sampled (verdicts in group order, one a candidate). The phase
    scheduler's gate reads them."""
    out: dict[str, dict] = {}
    start = 0
    for g in groups:
        end = start + len(g.candidates)
        entry = out.setdefault(g.request.phase, {"prompts": 0, "verdicts": []})
        entry["prompts"] += 1
        entry["verdicts"] += verdicts[start:end]
        start = end
    return {phase: {"prompts": e["prompts"], **rates(e["verdicts"])} for phase, e in out.items()}


def step_record(plan: StepPlan, groups: list[GroupRollout], verdicts: list, dropped: int) -> dict:
    """Per-step figures from verdicts: reward mean/std, compile / correct / cheat rates, speedup geomean, the
    prompts of each phase (``prompts_infill``, ``prompts_e2e``; ``infill_fraction`` is the share actually sampled,
    ``infill_target`` the curriculum's), each phase's figures (:func:`by_phase`) and the curriculum's decision."""
    rewards = [v.reward for v in verdicts]
    counts: dict[str, int] = {}
    for v in verdicts:
        counts[v.verdict] = counts.get(v.verdict, 0) + 1
    decision = asdict(plan.decision) if plan.decision is not None else None
    return {
        "step": plan.step,
        "phase": plan.stage,
        "infill_fraction": plan.infill_fraction,
        "infill_target": plan.infill_target,
        "prompts_infill": sum(r.phase == "infill" for r in plan.requests),
        "prompts_e2e": sum(r.phase == "e2e" for r in plan.requests),
        **rates(verdicts),  # candidates, reward_mean, compile_rate, correct_rate, speedup_geomean
        "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "cheat_rate": counts.get("cheat", 0) / max(len(verdicts), 1),
        "verdicts": counts,
        "groups": len(groups),
        "groups_dropped": dropped,
        "verifier_mode": verdicts[0].mode if verdicts else None,
        "by_phase": by_phase(groups, verdicts),
        "phase_decision": decision,
        "gate_figure": decision.get("value") if decision else None,
    }
