"""The verifier pool on the GPU(s) present (@pytest.mark.gpu): two GPU verifier actors (one GPU each
with two GPUs, half of one GPU each with one) verify 24 honest, incorrect and non-compiling
candidates while one actor is killed mid-batch (Ray restarts it; its in-flight work is re-sent).
Every candidate gets exactly one verdict, and the same verdict it gets alone from a serial Verifier."""

from __future__ import annotations

import pytest
import ray
import torch

from dice_ray.cluster.verifier_pool import VerifierPool
from dice_ray.config import RewardConfig, VerifyConfig
from dice_ray.tasks.loaders import load_tasks
from dice_ray.verify.verifier import Verifier
from _helpers import load_benchmark, wait_for_pool

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

#: built-in tasks whose first thread always writes an output no stale buffer holds by chance
TASKS = ("sigmoid", "exp", "softmax", "matmul", "layernorm", "gelu_tanh", "add", "sum_dim")
KINDS = ("correct", "incorrect", "compile_error")


def _variants():
    """The benchmark's candidate builder (benchmarks/verifier_throughput.py ``variants``)."""
    return load_benchmark("verifier_throughput").variants


@pytest.fixture(scope="module")
def items():
    """24 ``(candidate_id, task, source)``: each of 8 tasks honest, incorrect (its kernels skip their
    first thread) and non-compiling."""
    variants = _variants()
    tasks = {t.name: t for t in load_tasks("builtin").tasks if t.solution_format == "fast"}
    missing = [n for n in TASKS if n not in tasks]
    assert not missing, f"built-in tasks missing: {missing}"
    return [(f"{name}:{kind}", tasks[name], variants(tasks[name].solution_src)[kind]) for name in TASKS for kind in KINDS]


def test_pool_on_gpus_one_verdict_each_despite_actor_death(items):
    # each candidate alone, one at a time, in this process (before Ray holds the GPU)
    with Verifier(VerifyConfig(mode="gpu", workers=1), RewardConfig(), device=0) as serial:
        alone = {cid: serial.verify(task, src, cid).verdict for cid, task, src in items}
    for cid, task, src in items:
        if cid.endswith(":correct"):
            assert alone[cid] == "ok", cid
        if cid.endswith(":compile_error"):
            assert alone[cid] == "compile_error", cid
    assert "incorrect" in alone.values(), alone

    gpus = min(torch.cuda.device_count(), 2)
    per_actor = 1.0 if gpus >= 2 else 0.5
    # two actors on one GPU share its memory: each verifier's workers take under half of it
    cfg = VerifyConfig(mode="gpu", workers=3, gpu_memory_fraction=0.9 if gpus >= 2 else 0.45)
    ray.init(address="local", num_gpus=gpus, include_dashboard=False, namespace="dice-ray-test-gpu", log_to_driver=False)
    try:
        pool = VerifierPool.remote(cfg, RewardConfig(), 2, per_actor, 300.0)
        status = wait_for_pool(pool, lambda s: s["serving"] == 2, what="2 serving GPU actors", timeout=180.0, poll=0.1)
        assert status["mode"] == "gpu" and status["capacity_per_actor"] == 3
        if gpus >= 2:
            assert sorted(g for a in status["actors"] for g in a["gpu"]) == ["0", "1"], status["actors"]
        tasks = list({task.task_id: task for _, task, _ in items}.values())
        ray.get(pool.prepare.remote(tasks))  # as the trainer at start: each actor measures the reference facts
        wait_for_pool(pool, lambda s: all((a["prepared"] or {}).get("measured") == len(tasks) for a in s["actors"]),
                      what="each actor's reference facts measured", timeout=120.0, poll=0.1)
        ref = pool.verify_batch.remote(items)
        # mid-batch: some verdicts in, and work in flight on the actor to be killed
        status = wait_for_pool(pool, lambda s: s["completed"] >= 3 and max(a["in_flight"] for a in s["actors"]) >= 1,
                               what="a batch half done", timeout=180.0, poll=0.1)
        assert status["completed"] < len(items), "the batch finished before the kill"
        victim = max(range(2), key=lambda i: status["actors"][i]["in_flight"])
        ray.kill(ray.get(pool.actors.remote())[victim], no_restart=False)
        verdicts = ray.get(ref, timeout=240)

        assert [v.candidate_id for v in verdicts] == [cid for cid, _, _ in items]
        assert all(v.mode == "gpu" for v in verdicts)
        got = {v.candidate_id: v.verdict for v in verdicts}
        assert got == alone, {cid: (got[cid], alone[cid]) for cid in got if got[cid] != alone[cid]}
        status = wait_for_pool(pool, lambda s: s["serving"] == 2, what="the killed actor restarted and serving", timeout=180.0, poll=0.1)
        # the restarted actor is prepared again (its facts book started empty); the re-sent jobs may have measured some
        wait_for_pool(pool, lambda s: all(sum((a["prepared"] or {}).get(k, 0) for k in ("measured", "known")) == len(tasks)
                                          for a in s["actors"]), what="the restarted actor prepared", timeout=120.0, poll=0.1)
        assert [a["sandbox"]["reference_facts"] for a in ray.get(pool.status.remote())["actors"]] == [len(tasks)] * 2
        assert status["completed"] == status["submitted"] == len(items)
        assert sum(a["failures"] for a in status["actors"]) == 1 and sum(a["restarts"] for a in status["actors"]) == 1
        handles = ray.get(pool.actors.remote())
        ray.get(pool.close.remote())
        for h in handles:
            ray.kill(h, no_restart=True)
        ray.kill(pool)
    finally:
        ray.shutdown()
