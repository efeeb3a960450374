"""`dice-ray train` end to end on CPU through a real local Ray cluster, DeepSpeed learner and
NVRTC compile-only verifiers, with the asynchronous pipeline (issue 6: ``rl.max_staleness=1``, two rollout
lanes); then `--resume` continues from the last checkpoint, fetched from ``storage_path``.

One run tests both the default job's path and the asynchronous pipeline (each ``dice-ray train`` costs ~20 s
of the CI's 15 minutes); the synchronous pipeline's runs are tests/test_resume_exact.py's.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from dice_ray.cluster.metrics import intersect, total

pytestmark = pytest.mark.slow

SMALL = [
    "rl.steps=3", "rl.prompts_per_step=2", "rl.num_generations=2",
    "phase.infill_steps=1", "phase.ramp_steps=1",
    "sft.steps=8", "eval.heldout_tasks=1", "eval.train_tasks=1", "eval.samples=1", "eval.heldout_samples=1",  # a warm start
    "cluster.num_verifiers=1", "tasks.max_tasks=12",
    "rl.max_staleness=1", "cluster.num_rollout_workers=2",  # two lanes: consecutive steps sample on different workers
    "sampling.max_new_tokens=256",  # rollouts (~0.5 s) outlast a compile-only verification, as on GPUs
]
TIMING_KEYS = {"rollout_seconds", "verify_seconds", "learn_seconds", "sync_seconds", "idle_seconds",
               "rollout_busy_share", "verify_busy_share", "learner_busy_share", "timeline"}


def _train(args, env, timeout=600):
    cmd = [sys.executable, "-m", "dice_ray.cli", "train", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-4000:]}"
    # restartable actors take no constructor arguments Ray keeps in its object store (ray#53727)
    assert "constructor arguments in the object store" not in proc.stdout + proc.stderr
    assert "Token authentication is enabled" not in proc.stdout + proc.stderr  # Ray's notice on the safe default: not shown
    return proc.stdout


def test_train_covers_both_phases_then_resumes(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"PYTHONUNBUFFERED": "1"}
    store = tmp_path / "store"  # storage_path (issue 6): checkpoints copied there, the last 2 kept
    out = _train([f"run_dir={tmp_path}", "run_name=r", f"sft.cache_dir={tmp_path / 'sft'}", f"storage_path=file://{store}", *SMALL], env)
    assert "asynchronous, rollout up to 1 step(s) ahead" in out and "2 steps sampled side by side" in out
    run = tmp_path / "r"
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "curves.png"):
        assert (run / name).is_file(), name
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert [r["phase"] for r in records] == ["infill", "ramp", "e2e"]
    assert all(r["verifier_mode"] == "compile_only" for r in records)
    assert all(r["candidates"] == 4 for r in records)  # exactly one verdict a candidate
    assert "compile-only" in out and str(run) in out
    assert f"dice-ray eval --tasks builtin:24 --split heldout --model {run})" in " ".join(out.split())  # its own tasks
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3 and "e2e" in summary["phases_seen"]
    assert summary["heldout_start"] is not None and summary["heldout_end"] is not None
    assert sorted(p.name for p in (store / "r").iterdir()) == ["step_000002", "step_000003"]
    assert (store / "r" / "step_000003" / "state.json").is_file()
    # the checkpoint after step 1 was taken with step 2 drawn ahead: it saves the scheduler from before that draw
    assert json.loads((store / "r" / "step_000002" / "state.json").read_text())["schedule"]["step"] == 2
    shutil.rmtree(run / "checkpoints")  # resume must fetch the newest checkpoint from storage_path
    (run / "stopped.json").write_text('{"reason": "interrupted"}')  # as a Ctrl-C leaves it: a new session clears it

    out2 = _train(["--resume", str(run), "rl.steps=5"], env)
    assert "resumed" in out2 and "step_000003" in out2
    assert sorted(p.name for p in (store / "r").iterdir()) == ["step_000004", "step_000005"]
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert [r["phase"] for r in records[2:]] == ["e2e"] * 3
    assert records[-1]["weights_version"] == 5
    assert not (run / "stopped.json").exists()
    resumed = json.loads((run / "summary.json").read_text())
    assert resumed["steps"] == 5 and resumed["heldout_start"] == summary["heldout_start"]
    # the asynchronous pipeline: step 0 and the first step after the resume sample fresh weights, the others lag
    # exactly one version (the proof that step t+1 was sampled before step t's update: launched ahead)
    assert [r["staleness_max"] for r in records] == [0, 1, 1, 0, 1]
    assert all(TIMING_KEYS <= set(r) and r["idle_seconds"] >= 0 for r in records)
    assert all(0 <= r[k] <= 1 for r in records for k in ("rollout_busy_share", "verify_busy_share", "learner_busy_share"))
    assert all(r["gpu_busy_share"] is None for r in records)  # no GPU here
    # how long rollout and learning overlapped is timing (the tiny rollout may end before learning starts on a
    # busy machine: tests/test_async_pipeline.py measures it with controlled stage times); here the recorded
    # overlap must agree with the recorded intervals
    for r in records:
        tlv = {k: [tuple(iv) for iv in v] for k, v in r["timeline"].items()}
        assert total(intersect(tlv["rollout"], tlv["learn"])) == pytest.approx(r["rollout_learn_overlap_seconds"], abs=1e-3)
    assert "warm start" in out and "SFT steps on" in out and "cache_hit" not in out  # trained now, said in words
    assert "M params, built, warm-started by SFT;" in out  # the learner line says where the weights came from
    assert "\x1b[" not in out  # not a terminal: no colour codes (Ray's actor prefixes included)
