"""The BiC-RL phase schedule: ramp without an abrupt switch, curriculum order, exact resume."""

import pytest

from dice_ray.cluster.scheduler import PhaseSchedule
from dice_ray.config import PhaseConfig

TASKS = [(f"t{i}", 1 + (i % 2), True) for i in range(10)]


def test_infill_fraction_ramps_down_monotonically():
    s = PhaseSchedule(TASKS, PhaseConfig(infill_steps=2, ramp_steps=3, final_infill_fraction=0.0), 4, seed=0)
    fr = [s.infill_fraction(t) for t in range(8)]
    assert fr[:2] == [1.0, 1.0]
    assert fr[5:] == [0.0, 0.0, 0.0]
    assert all(a > b for a, b in zip(fr[1:6], fr[2:6]))  # strictly decreasing through the ramp
    assert max(a - b for a, b in zip(fr, fr[1:])) < 0.5  # no abrupt switch
    assert [s.phase_name(t) for t in range(6)] == ["infill", "infill", "ramp", "ramp", "ramp", "e2e"]


def test_batches_mix_phases_and_follow_level_curriculum():
    s = PhaseSchedule(TASKS, PhaseConfig(infill_steps=1, ramp_steps=1, final_infill_fraction=0.0), 4, seed=3)
    step, frac, phase, reqs = s.next_batch()
    assert (step, frac, phase) == (0, 1.0, "infill")
    assert [r.phase for r in reqs] == ["infill"] * 4
    levels = {t: lv for t, lv, _ in TASKS}
    assert all(levels[r.task_id] == 1 for r in reqs)  # level 1 first
    _, frac, _, reqs = s.next_batch()
    assert [r.phase for r in reqs] == ["infill", "infill", "e2e", "e2e"] and frac == 0.5
    assert len({r.request_id for r in reqs}) == 4


def test_resume_gives_the_same_prompts():
    cfg = PhaseConfig(infill_steps=2, ramp_steps=2)
    a = PhaseSchedule(TASKS, cfg, 3, seed=1)
    straight = [a.next_batch() for _ in range(8)]
    b = PhaseSchedule(TASKS, cfg, 3, seed=1)
    first = [b.next_batch() for _ in range(3)]
    c = PhaseSchedule(TASKS, cfg, 3, seed=1)
    c.set_state(b.get_state())
    assert first + [c.next_batch() for _ in range(5)] == straight


def test_no_tasks_is_an_error():
    with pytest.raises(ValueError, match="no training tasks"):
        PhaseSchedule([], PhaseConfig(), 4, seed=0)


def test_task_without_scaffold_is_prompted_end_to_end():
    tasks = [("a", 1, False), ("b", 1, True)]
    s = PhaseSchedule(tasks, PhaseConfig(infill_steps=5), 2, seed=0)
    _, frac, _, reqs = s.next_batch()
    assert frac == 1.0
    assert {r.task_id: r.phase for r in reqs} == {"a": "e2e", "b": "infill"}
