"""Exact resume and free rollout crashes (issue 6): 6 RL steps straight, and 3 steps with a rollout worker crashing
mid-step + ``--resume`` 3, give the same per-step metrics, on CPU with compile-only verifiers, a deterministic config
and a shared SFT cache.

The warm start (100 SFT steps: enough for a mix of compiling and
failing candidates, so the learner has groups to train on) is cached by its content hash in conftest's
``sft_cache``, so only the first run pays for it. The config (``_helpers.DETERMINISTIC``) makes the resume point fall
inside the infill -> end-to-end ramp and the data order wrap into a new epoch on both sides of it, and turns on the
paths that hold learner-side state: a KL reference (``rl.beta``) and the ``coupled`` estimator (masks seeded by the
learner's step count). The crash (the :data:`~dice_ray.cluster.rollout.FAULT_ENV` hook) kills the rollout worker in
step 2's ``generate``: restarted, re-synced and re-sampled, it must change nothing either. One run tests both (each
``dice-ray train`` costs ~20 s of the CI's 15 minutes); a failure's diff names the step, before or after the resume.
"""

import json
import math
import os

import pytest

from _helpers import DETERMINISTIC, TIMING, train_cli
from dice_ray.cluster.rollout import FAULT_ENV

pytestmark = pytest.mark.slow


def _records(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    return a == b


def test_three_steps_with_a_rollout_crash_plus_resume_equal_six_straight(tmp_path, sft_cache):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", FAULT_ENV)} | {"PYTHONUNBUFFERED": "1"}
    train_cli([f"run_dir={tmp_path}", "run_name=straight", f"sft.cache_dir={sft_cache}", "rl.steps=6", *DETERMINISTIC], env)
    marker = tmp_path / "crashed"
    # the worker's 3rd generate call is step 2's rollout: its re-sampled groups are what step 2 learns on
    train_cli([f"run_dir={tmp_path}", "run_name=split", f"sft.cache_dir={sft_cache}", "rl.steps=3", *DETERMINISTIC],
              env | {FAULT_ENV: f"3:{marker}"})
    assert marker.exists(), "the fault hook did not fire"
    out = train_cli(["--resume", str(tmp_path / "split"), "rl.steps=6"], env)
    assert "resumed" in out

    straight, split = _records(tmp_path / "straight"), _records(tmp_path / "split")
    assert [r["step"] for r in straight] == [r["step"] for r in split] == list(range(6))
    assert [r["phase"] for r in straight] == ["infill", "infill", "ramp", "ramp", "ramp", "e2e"]
    assert [r["rollout_restarts"] for r in straight] == [0] * 6
    assert split[2]["rollout_restarts"] >= 1 and straight[2]["loss"] is not None  # the crashed step trained
    # the learner trained at steps on both sides of the resume (else the comparison proves little)
    assert any(r["loss"] is not None for r in straight[:3]) and any(r["loss"] is not None for r in straight[3:])
    diffs = [
        (r["step"], k, r.get(k), s.get(k))
        for r, s in zip(straight, split)
        for k in sorted((set(r) | set(s)) - TIMING)
        if not _same(r.get(k), s.get(k))
    ]
    assert not diffs, "the crash or the resume changed the run (step, field, straight, split):\n" + "\n".join(map(str, diffs))
