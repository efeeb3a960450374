"""The BiC-RL phase schedule: the fixed ramp, the metric gate, the collapse guard, the phase pools, exact resume."""

import pytest

from dice_ray.cluster.scheduler import PhaseSchedule
from dice_ray.config import PhaseConfig

TASKS = [(f"t{i}", 1 + (i % 2)) for i in range(10)]


def fixed(**kw) -> PhaseConfig:
    return PhaseConfig(schedule="fixed", **kw)


def gated(**kw) -> PhaseConfig:
    return PhaseConfig(schedule="gated", **{"infill_steps": 20, "ramp_steps": 2, "gate_threshold": 0.5,
                                            "gate_window": 2,
                                            "final_infill_fraction": 0.0, **kw})


def figures(step: int, infill: float | None = None, e2e: float | None = None, correct: float | None = None) -> dict:
    """A step record as the trainer posts it: per-phase figures (compile rate = reward in these tests)."""
    by_phase = {}
    if infill is not None:
        by_phase["infill"] = {"prompts": 4, "compile_rate": infill, "reward_mean": infill, "correct_rate": correct}
    if e2e is not None:
        by_phase["e2e"] = {"prompts": 4, "compile_rate": e2e, "reward_mean": e2e, "correct_rate": None}
    return {"step": step, "by_phase": by_phase}


def test_fixed_schedule_ramps_down_monotonically_and_says_when():
    s = PhaseSchedule(TASKS, TASKS, fixed(infill_steps=2, ramp_steps=3, final_infill_fraction=0.0), 4, seed=0)
    plans = [s.next_batch() for _ in range(8)]
    fr = [p.infill_target for p in plans]
    assert fr[:2] == [1.0, 1.0] and fr[5:] == [0.0, 0.0, 0.0]
    assert all(a > b for a, b in zip(fr[1:6], fr[2:6]))  # strictly decreasing through the ramp
    assert max(a - b for a, b in zip(fr, fr[1:])) < 0.5  # no abrupt switch
    assert [p.stage for p in plans[:6]] == ["infill", "infill", "ramp", "ramp", "ramp", "e2e"]
    decisions = {p.step: p.decision for p in plans if p.decision is not None}
    assert {k: d.action for k, d in decisions.items()} == {2: "leave-infill", 5: "ramp-done"}
    assert "phase.infill_steps=2" in decisions[2].reason and decisions[2].metric is None


def test_batches_draw_each_phase_from_its_pool_in_level_order():
    infill, e2e = [("a", 1), ("b", 2)], [("x", 2), ("y", 1), ("z", 3)]
    s = PhaseSchedule(infill, e2e, fixed(infill_steps=1, ramp_steps=1, final_infill_fraction=0.0), 4, seed=3)
    p = s.next_batch()
    assert (p.step, p.infill_target, p.stage, p.infill_fraction) == (0, 1.0, "infill", 1.0)
    assert [r.task_id for r in p.requests][:2] == ["a", "b"]  # level 1 first
    p = s.next_batch()
    assert [r.phase for r in p.requests] == ["infill", "infill", "e2e", "e2e"] and p.infill_fraction == 0.5
    assert {r.task_id for r in p.requests if r.phase == "e2e"} <= {"x", "y", "z"}
    assert [r.task_id for r in p.requests if r.phase == "e2e"] == ["y", "x"]  # the e2e pool's level order
    assert len({r.request_id for r in p.requests}) == 4


def test_gate_leaves_infilling_on_the_measured_figure():
    s = PhaseSchedule(TASKS, TASKS, gated(), 4, seed=0)
    plans = []
    for step, rate in enumerate([0.2, 0.45, 0.6, 0.7]):
        plans.append(s.next_batch())
        s.observe(figures(step, infill=rate))
    plans.append(s.next_batch())
    assert [p.stage for p in plans] == ["infill", "infill", "infill", "ramp", "ramp"]
    d = plans[3].decision
    assert (d.step, d.action, d.metric, d.threshold) == (3, "leave-infill", "compile_rate", 0.5)
    assert d.value == pytest.approx(0.525) and "steps 1-2" in d.reason  # mean of the last two: 0.45, 0.6
    assert plans[3].infill_target == pytest.approx(2 / 3) and plans[4].infill_target == pytest.approx(1 / 3)


def test_gate_reads_the_correct_rate_once_a_gpu_verifier_measures_it():
    s = PhaseSchedule(TASKS, TASKS, gated(), 4, seed=0)
    for step in range(2):  # compile rate high, correct rate low: the gate stays shut
        s.next_batch()
        s.observe(figures(step, infill=0.9, correct=0.1))
    p = s.next_batch()
    assert p.stage == "infill" and p.decision is None and s.gate_metric(3) == "correct_rate"


def test_gate_opens_at_infill_steps_at_the_latest():
    s = PhaseSchedule(TASKS, TASKS, gated(infill_steps=3), 4, seed=0)
    plans = []
    for step in range(4):
        plans.append(s.next_batch())
        s.observe(figures(step, infill=0.1))
    assert [p.stage for p in plans] == ["infill"] * 3 + ["ramp"]
    assert plans[3].decision.action == "leave-infill" and "phase.infill_steps=3" in plans[3].decision.reason


def test_decisions_read_only_figures_old_enough_for_the_lag():
    """With lag 1 (one step drawn ahead), step t's decision reads steps <= t-2: a figure posted early changes nothing."""
    early, late = PhaseSchedule(TASKS, TASKS, gated(), 4, 0, lag=1), PhaseSchedule(TASKS, TASKS, gated(), 4, 0, lag=1)
    for step, rate in enumerate([0.9, 0.9, 0.9]):
        early.observe(figures(step, infill=rate))
    stages_early = [early.next_batch().stage for _ in range(4)]
    stages_late = []
    for step in range(4):
        stages_late.append(late.next_batch().stage)
        if step < 3:
            late.observe(figures(step, infill=0.9))
    assert stages_early == stages_late == ["infill", "infill", "infill", "ramp"]


def test_collapse_raises_and_holds_infilling_until_the_e2e_reward_recovers():
    s = PhaseSchedule(TASKS, TASKS, gated(ramp_steps=3, collapse_ratio=0.5), 4, seed=0)
    e2e = [None, None, 0.4, 0.4, 0.1, 0.1, 0.1, 0.4, 0.4, 0.4]
    plans = []
    for step, r in enumerate(e2e):
        plans.append(s.next_batch())
        s.observe(figures(step, infill=0.9, e2e=r))
    acts = {p.step: p.decision.action for p in plans if p.decision is not None}
    # the ramp reaches end-to-end at step 5; the windowed e2e reward (0.1) falls under 0.5 x its best (0.4) at step 6:
    # infilling goes back up one ramp step and holds; one good step brings the window back over the bar at step 8
    assert acts == {2: "leave-infill", 5: "ramp-done", 6: "collapse", 8: "recover", 9: "ramp-done"}
    assert [p.infill_target for p in plans] == pytest.approx([1, 1, 0.75, 0.5, 0.25, 0, 0.25, 0.25, 0.25, 0])
    assert [p.stage for p in plans][5:] == ["e2e", "ramp", "ramp", "ramp", "e2e"]
    collapse = plans[6].decision
    assert collapse.metric == "e2e_reward_mean" and collapse.value == pytest.approx(0.1)
    assert collapse.threshold == pytest.approx(0.2)  # 0.5 x the best windowed mean, 0.4


def test_resume_gives_the_same_prompts_and_decisions():
    rates = [0.3, 0.6, 0.7, 0.8, 0.2, 0.2, 0.9, 0.9]

    def run(schedule: PhaseSchedule, steps: range) -> list:
        out = []
        for step in steps:
            out.append(schedule.next_batch())
            schedule.observe(figures(step, infill=rates[step], e2e=rates[step]))
        return out

    straight = run(PhaseSchedule(TASKS, TASKS[:4], gated(), 3, seed=1), range(8))
    first = PhaseSchedule(TASKS, TASKS[:4], gated(), 3, seed=1)
    head = run(first, range(3))
    resumed = PhaseSchedule(TASKS, TASKS[:4], gated(), 3, seed=1)
    resumed.set_state(first.get_state())
    assert head + run(resumed, range(3, 8)) == straight
    assert any(p.decision is not None for p in straight[3:])  # the resumed part decided something


def test_no_tasks_is_an_error_and_no_infilling_tasks_go_end_to_end():
    with pytest.raises(ValueError, match="no training tasks"):
        PhaseSchedule([], [], PhaseConfig(), 4, seed=0)
    s = PhaseSchedule([], TASKS, PhaseConfig(), 4, seed=0)
    p = s.next_batch()
    assert p.decision.action == "no-infill" and p.stage == "e2e" and p.infill_fraction == 0.0
    assert {r.phase for r in p.requests} == {"e2e"}
