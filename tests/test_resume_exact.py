"""Exact resume and free rollout crashes (issue 6): a run resumed from its step-3 checkpoint, with a rollout worker
crashing in the first step it samples, gives the same per-step metrics as the 6 steps straight, on CPU with
compile-only verifiers, a deterministic config and a shared SFT cache.

The warm start (100 SFT steps: enough for a mix of compiling and failing candidates, so the learner has groups to
train on) is cached by its content hash in conftest's ``sft_cache``, so only the first session pays for it. The
config (``_helpers.DETERMINISTIC``) makes the resume point fall inside the infill -> end-to-end ramp and the data
order wrap into a new epoch on both sides of it, and turns on the paths that hold learner-side state: a KL reference
(``rl.beta``) and the ``coupled`` estimator (masks seeded by the learner's step count). The resumed copy is the
straight run's folder as an interruption after step 3 leaves it: its checkpoints up to step 3 kept, its metrics
of the later steps still written (the resume drops them). The crash (the :data:`~dice_ray.cluster.rollout.FAULT_ENV`
hook) kills the rollout worker in step 3's ``generate``: restarted, re-synced and re-sampled, it must change nothing
either. Two ``dice-ray train`` launches test both (each costs ~20-30 s of the CI's 15 minutes); a failure's diff
names the step.
"""

import json
import math
import os
import shutil

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


def test_resume_from_step_three_with_a_rollout_crash_equals_six_straight(tmp_path, sft_cache):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", FAULT_ENV)} | {"PYTHONUNBUFFERED": "1"}
    straight, split = tmp_path / "straight", tmp_path / "split"
    train_cli([f"run_dir={tmp_path}", "run_name=straight", f"sft.cache_dir={sft_cache}", "rl.steps=6",
               "keep_checkpoints=6", *DETERMINISTIC], env)
    shutil.copytree(straight, split)
    for ckpt in (split / "checkpoints").glob("step_*"):
        if int(ckpt.name.split("_")[1]) > 3:
            shutil.rmtree(ckpt)
    marker = tmp_path / "crashed"
    # the resumed worker's 1st generate call is step 3's rollout: its re-sampled groups are what step 3 learns on
    out = train_cli(["--resume", str(split)], env | {FAULT_ENV: f"1:{marker}"})
    assert "resumed" in out and "step_000003" in out
    assert marker.exists(), "the fault hook did not fire"

    a, b = _records(straight), _records(split)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(6))
    assert [r["phase"] for r in a] == ["infill", "infill", "ramp", "ramp", "ramp", "e2e"]
    assert [r["rollout_restarts"] for r in a] == [0] * 6
    assert b[3]["rollout_restarts"] >= 1 and a[3]["loss"] is not None  # the crashed step trained
    # the learner trained at steps on both sides of the resume (else the comparison proves little)
    assert any(r["loss"] is not None for r in a[:3]) and any(r["loss"] is not None for r in a[3:])
    diffs = [
        (r["step"], k, r.get(k), s.get(k))
        for r, s in zip(a, b)
        for k in sorted((set(r) | set(s)) - TIMING)
        if not _same(r.get(k), s.get(k))
    ]
    assert not diffs, "the crash or the resume changed the run (step, field, straight, resumed):\n" + "\n".join(map(str, diffs))
