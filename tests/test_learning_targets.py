"""The GPU targets of ``benchmarks/learning.py`` (issue 44) on made-up results: the rl arm's correct rate and
end-to-end speedup must rise (to >= 1.3x with the slower variants in the warm start), the control's must not; the
speedup is read from the end-to-end samples only (an infilling scaffold fixes the kernel), and an evaluation's
slower-variant share is counted by kernel, not by speed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from _helpers import load_benchmark
from dice_ray.cluster.evaluation import eval_figures
from dice_ray.tasks.loaders import load_tasks

learning = load_benchmark("learning")


def entry(correct: tuple, e2e: tuple, infill: tuple = (1.0, 1.0), slow: tuple = (0.5, 0.1)) -> dict:
    """A run's entry with correct rates, end-to-end and infilling speedups and e2e slow shares at (start, end)."""
    return {"reward_start": 0.3, "reward_end": 0.5, "heldout_start": None, "heldout_end": None,
            "heldout_ok_start": None, "heldout_ok_end": None, "computes_end": 1.0,
            "speedup_start": None, "speedup_end": None, "correct_start": correct[0], "correct_end": correct[1],
            "speedup_geomean_by_phase": {w: {"infill": infill[i], "e2e": e2e[i]} for i, w in enumerate(("start", "end"))},
            "slow_share_by_phase": {w: {"infill": 0.0, "e2e": slow[i]} for i, w in enumerate(("start", "end"))}}


def result(rl: dict, control: dict, variants: bool = True) -> dict:
    return {"device": "cuda", "seeds": [0], "speedup_variants": variants, "arms": {"rl": [rl], "control": [control]},
            "seconds": 100.0}


def missed(res: dict) -> list[str]:
    return [name for name, ok, _ in learning.check_targets(res) if not ok]


def test_rl_rising_and_a_flat_control_meet_every_gpu_target():
    res = result(entry((0.3, 0.5), (0.30, 0.45)), entry((0.3, 0.3), (0.30, 0.30)))
    assert missed(res) == []
    text = learning.describe(res)
    assert "e2e speedup start" in text and "MISSED" not in text and "50%" in text  # the slower-variant share


@pytest.mark.parametrize("rl, control, why", [
    (entry((0.3, 0.5), (0.30, 0.36)), entry((0.3, 0.3), (0.3, 0.3)), "rl seed 0: end-to-end speedup geomean end > 1.3x"),
    (entry((0.3, 0.3), (0.30, 0.45)), entry((0.3, 0.3), (0.3, 0.3)), "rl seed 0: correct rate rises"),
    (entry((0.3, 0.5), (0.30, 0.45)), entry((0.3, 0.4), (0.3, 0.3)), "control seed 0: correct rate"),
    (entry((0.3, 0.5), (0.30, 0.45)), entry((0.3, 0.3), (0.3, 0.4)), "control seed 0: end-to-end speedup"),
    (entry((0.3, 0.5), (None, 0.45)), entry((0.3, 0.3), (0.3, 0.3)), "rl seed 0: end-to-end speedup"),
])
def test_each_gpu_target_is_missed_on_its_own(rl, control, why):
    assert [m for m in missed(result(rl, control)) if m.startswith(why)], missed(result(rl, control))
    assert "MISSED" in learning.describe(result(rl, control))


def test_infilling_speedups_do_not_count_and_without_variants_a_rise_is_enough():
    # a 3x infilling rise does not make up for a flat end-to-end speedup
    res = result(entry((0.3, 0.5), (0.30, 0.30), infill=(0.3, 0.9)), entry((0.3, 0.3), (0.3, 0.3)))
    assert any("end-to-end speedup" in m for m in missed(res))
    assert missed(result(entry((0.3, 0.5), (0.30, 0.33)), entry((0.3, 0.3), (0.3, 0.3)), variants=False)) == []


def test_an_evaluation_counts_the_rewarded_samples_that_reproduce_a_slower_variant():
    tasks = {t.task_id: t for t in load_tasks("builtin").tasks if t.solution_variants}
    relu = next(t for t in tasks.values() if t.name == "relu")
    srcs = [relu.solution_src, relu.solution_variants[0], relu.solution_variants[0], "import torch\n"]
    group = SimpleNamespace(request=SimpleNamespace(task_id=relu.task_id), candidates=srcs)
    v = lambda reward: SimpleNamespace(reward=reward, compiled=True, verdict="ok", mode="gpu", correct=True,  # noqa: E731
                                       speedup=1.0, cheat=False)
    figures = eval_figures([group], [v(1.0), v(0.5), v(0.0), v(1.0)], tasks)
    # rewarded: the solution, one slower variant and a candidate that reproduces neither (not counted)
    assert figures["slow_share"] == pytest.approx(1 / 2)
    assert eval_figures([group], [v(1.0), v(0.0), v(0.0), v(0.0)], tasks)["slow_share"] == 0.0
