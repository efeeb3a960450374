"""Exact resume (issue 6): 6 RL steps straight and 3 steps + ``--resume`` 3 give the same per-step
metrics, on CPU with compile-only verifiers, a deterministic config and a shared SFT cache.

The straight run is conftest's ``straight_run`` (tests/test_rollout_fault.py compares with it too). The
warm start (100 SFT steps: enough for a mix of compiling and failing candidates, so the learner has
groups to train on) is cached by its content hash in conftest's ``sft_cache``, so only the first run
pays for it. The config (``_helpers.DETERMINISTIC``) makes the resume point fall inside the infill ->
end-to-end ramp and the data order wrap into a new epoch on both sides of it, and turns on the paths
that hold learner-side state: a KL reference (``rl.beta``) and the ``coupled`` estimator (masks seeded
by the learner's step count).
"""

import json
import math
import os

import pytest

from _helpers import DETERMINISTIC, train_cli

pytestmark = pytest.mark.slow

# wall-clock figures and what derives from them; everything else in a record must match
TIMING = {
    "learner_step_seconds", "rollout_seconds", "verify_seconds", "learn_seconds", "sync_seconds",
    "rollout_tokens_per_s", "verifier_throughput", "verifier_queue_depth", "verifier_pool_size", "step_seconds",
    # stage timeline figures of dice_ray.cluster.metrics (issue 6's asynchronous pipeline)
    "idle_seconds", "checkpoint_seconds", "rollout_busy_share", "verify_busy_share", "learner_busy_share",
    "rollout_learn_overlap_seconds", "timeline", "gpu_busy_share", "gpu_busy_share_mean", "gpu_busy_share_min",
}


def _records(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    return a == b


def test_three_steps_plus_resume_equal_six_straight(tmp_path, sft_cache, straight_run):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"PYTHONUNBUFFERED": "1"}
    train_cli([f"run_dir={tmp_path}", "run_name=split", f"sft.cache_dir={sft_cache}", "rl.steps=3", *DETERMINISTIC], env)
    out = train_cli(["--resume", str(tmp_path / "split"), "rl.steps=6"], env)
    assert "resumed" in out

    straight, split = _records(straight_run), _records(tmp_path / "split")
    assert [r["step"] for r in straight] == [r["step"] for r in split] == list(range(6))
    assert [r["phase"] for r in straight] == ["infill", "infill", "ramp", "ramp", "ramp", "e2e"]
    # the learner trained at steps on both sides of the resume (else the comparison proves little)
    assert any(r["loss"] is not None for r in straight[:3]) and any(r["loss"] is not None for r in straight[3:])
    diffs = [
        (r["step"], k, r.get(k), s.get(k))
        for r, s in zip(straight, split)
        for k in sorted((set(r) | set(s)) - TIMING)
        if not _same(r.get(k), s.get(k))
    ]
    assert not diffs, "resumed run diverged (step, field, straight, resumed):\n" + "\n".join(map(str, diffs))
