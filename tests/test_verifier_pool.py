"""The verifier pool on a real local Ray cluster: one verdict per candidate, even when a verifier
actor is killed mid-batch; several candidates in flight per actor; live scale up and down through
the ``dice-ray verifiers`` command while batches run (draining actors finish their work);
autoscaling by queue depth; compile-only verdicts on CPU."""

import json
import math
import subprocess
import sys
import threading
import time

import pytest
import ray

from dice_ray import cli
from dice_ray.cluster.verifier_pool import NAMESPACE, POOL_NAME, TICK_S, VerifierPool
from dice_ray.config import ClusterConfig, RewardConfig, VerifyConfig
from dice_ray.tasks.loaders import load_tasks
from _helpers import joined_ray, wait_for_pool

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(ray_head):
    """The shared local Ray cluster, joined; yields its address (what ``--address`` / RAY_ADDRESS take)."""
    with joined_ray(ray_head, namespace="dice-ray-test"):
        yield ray.get_runtime_context().gcs_address


@pytest.fixture(scope="module")
def relu():
    return next(t for t in load_tasks("builtin").tasks if t.name.endswith("relu"))


def _batch(task, n, prefix):
    broken = task.solution_src.replace("__global__", "__global__ oops", 1)
    return [(f"{prefix}{i}", task, task.solution_src if i % 2 == 0 else broken) for i in range(n)]


def _check(items, verdicts):
    """One verdict per candidate, in order, and the right one (no crash, no timeout)."""
    assert [v.candidate_id for v in verdicts] == [cid for cid, _, _ in items]
    for (cid, task, src), v in zip(items, verdicts):
        assert v.mode == "compile_only"
        assert v.verdict == ("ok" if src == task.solution_src else "compile_error"), (cid, v.verdict, v.reason[:300])


def test_exactly_one_verdict_per_candidate_despite_actor_death(cluster, relu):
    # two actors, two candidates in flight on each (VerifyConfig.workers=2)
    pool = VerifierPool.remote(VerifyConfig(workers=2), RewardConfig(), 2, 0.0, 120.0)
    wait_for_pool(pool, lambda s: s["serving"] == 2, what="2 serving actors")
    ray.get(pool.prepare.remote([relu]))  # each actor's own concurrency group: nothing to measure without a GPU
    wait_for_pool(pool, lambda s: all("compile-only" in (a["prepared"] or {}).get("skipped", "") for a in s["actors"]),
                  what="each actor's prepare summary")
    items = _batch(relu, 12, "c")
    ref = pool.verify_batch.remote(items)
    status = wait_for_pool(pool, lambda s: s["in_flight"] >= 3, what="candidates in flight")
    assert status["capacity_per_actor"] == 2 and max(a["in_flight"] for a in status["actors"]) == 2
    # kill one verifier actor while the batch is in flight (Ray restarts it; its work is re-sent)
    victim = ray.get(pool.actors.remote())[0]
    ray.kill(victim, no_restart=False)
    verdicts = ray.get(ref, timeout=300)
    assert [v.candidate_id for v in verdicts] == [cid for cid, _, _ in items]
    assert all(v.mode == "compile_only" for v in verdicts)
    # a candidate in flight on the killed actor is re-sent alone; it gets a crash verdict only if
    # its actor dies again while it runs alone, which nothing here does
    _check(items, verdicts)
    status = ray.get(pool.status.remote())
    assert status["completed"] == status["submitted"] == 12
    assert sum(a["failures"] for a in status["actors"]) == 1 and sum(a["restarts"] for a in status["actors"]) == 1
    # each serving actor's sandbox counters (compile-only: spares start at the first replacement)
    boxes = [a["sandbox"] for a in status["actors"]]
    assert all(b is not None and b["workers"] == 2 and b["spares_ready"] <= b["spares"] for b in boxes), boxes
    assert status["spares"] == sum(b["spares"] for b in boxes) and status["promoted"] == sum(b["promoted"] for b in boxes)
    ray.kill(pool)


def test_cli_scales_a_running_job_while_batches_run(cluster, relu, capsys):
    """`dice-ray verifiers scale 3`, then `scale 1`, on the named pool of a "job" that keeps submitting."""
    pool = VerifierPool.options(name=POOL_NAME, namespace=NAMESPACE).remote(
        VerifyConfig(workers=1), RewardConfig(), 2, 0.0, 120.0
    )

    def verifiers(*args):
        rc = cli.main(["verifiers", *args, "--address", cluster, "--json"])
        out = capsys.readouterr()
        return rc, (json.loads(out.out) if rc == 0 else out.err)

    try:
        wait_for_pool(pool, lambda s: s["serving"] == 2, what="2 serving actors")
        done: list = []
        failed: list = []
        stop = threading.Event()

        def job(tag):  # the trainer's verify stage, over and over, from four threads
            k = 0
            try:
                while not stop.is_set():
                    items = _batch(relu, 4, f"{tag}{k}-")
                    done.append((items, ray.get(pool.verify_batch.remote(items), timeout=300)))
                    k += 1
            except Exception as exc:  # noqa: BLE001 - reported by the main thread
                failed.append(exc)

        threads = [threading.Thread(target=job, args=(tag,), daemon=True) for tag in "abcd"]
        for t in threads:
            t.start()

        rc, status = verifiers("scale", "3")
        assert rc == 0 and status["size"] == 3, status
        wait_for_pool(pool, lambda s: s["size"] == 3 and all(a["done"] > 0 for a in s["actors"]), what="3 actors serving")
        wait_for_pool(pool, lambda s: s["queue_depth"] >= 2 and all(a["in_flight"] for a in s["actors"]), what="3 busy actors")

        rc, status = verifiers("scale", "1")
        assert rc == 0 and status["size"] == 1 and status["draining"] == 2 and status["scaled_from"] == 3, status
        assert cli.main(["verifiers", "scale", "1", "--address", cluster]) == 0  # to its size: says so, changes nothing
        assert "target is 1 actor already: nothing changed" in capsys.readouterr().err
        rc, status = verifiers("status")
        assert rc == 0 and status["size"] == 1
        status = wait_for_pool(pool, lambda s: s["draining"] == 0 and len(s["retired"]) == 2, what="drained actors retired")
        # the drained actors finished what they had in flight (nothing re-sent, nothing failed)
        retired = status["retired"]
        assert sum(r["in_flight_at_drain"] for r in retired) >= 1, retired
        assert all(r["done_after_drain"] == r["in_flight_at_drain"] and r["failures"] == 0 for r in retired), retired
        n_before = len(done)
        wait_for_pool(pool, lambda s: len(done) >= n_before + 1, what="a batch on the shrunk pool")

        stop.set()
        for t in threads:
            t.join(timeout=120)
        assert not failed, failed
        for items, verdicts in done:
            _check(items, verdicts)
        ids = [v.candidate_id for _, verdicts in done for v in verdicts]
        assert len(ids) == len(set(ids)) and len(ids) >= 12
        status = ray.get(pool.status.remote())
        assert status["completed"] == status["submitted"] == len(ids)
        assert status["size"] == 1 and [a["state"] for a in status["actors"]] == ["serving"]

        # the real command line, as a separate driver through the job's Ray address
        proc = subprocess.run(
            [sys.executable, "-m", "dice_ray.cli", "verifiers", "status", "--address", cluster, "--json"],
            check=False, capture_output=True, text=True, timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["size"] == 1
        for bad in ("0", "-2"):
            rc, err = verifiers("scale", bad)
            assert rc == 2 and "N must be an integer >= 1" in err and len(err.strip().splitlines()) == 1
        with pytest.raises(ray.exceptions.RayTaskError, match=">= 1"):
            ray.get(pool.scale.remote(0))
    finally:
        ray.kill(pool)


def test_autoscale_grows_with_the_queue_and_drains_back(cluster, relu):
    cc = ClusterConfig(
        verifier_autoscale=True, min_verifiers=1, max_verifiers=2, verifier_target_queue=1.0, verifier_scale_cooldown_s=1.0
    )
    pool = VerifierPool.remote(VerifyConfig(), RewardConfig(), 5, 0.0, 120.0, cc)
    try:
        status = ray.get(pool.status.remote())
        assert status["autoscale"] == {"min": 1, "max": 2, "target_queue": 1.0, "cooldown_s": 1.0}
        assert status["size"] == 2  # the starting size 5 is clamped into [1, 2]
        # the batch must outlast the pool's rules, not this machine's speed: growth waits out the cool-down
        # since the last resize and is decided once a tick (TICK_S), so the batch is sized to last 3 ticks
        wait_for_pool(pool, lambda s: s["size"] == 1 and s["draining"] == 0, what="idle pool shrunk to the minimum")
        for probe in ("warm", "probe"):  # one candidate at a time changes no size; the second is timed
            t0 = time.monotonic()
            _check(one := _batch(relu, 1, probe), ray.get(pool.verify_batch.remote(one), timeout=300))
        n = max(12, math.ceil(3 * TICK_S / (time.monotonic() - t0)))
        time.sleep(cc.verifier_scale_cooldown_s)
        items = _batch(relu, n, "q")
        ref = pool.verify_batch.remote(items)
        wait_for_pool(pool, lambda s: s["size"] == 2, what="pool grown by queue depth")
        _check(items, ray.get(ref, timeout=300))
        status = wait_for_pool(pool, lambda s: s["size"] == 1 and s["draining"] == 0, what="pool shrunk after the batch")
        assert status["completed"] == status["submitted"] == n + 2
    finally:
        ray.kill(pool)


def test_timeout_restarts_the_actor_and_resends_the_bystander(cluster, relu):
    # a call timeout far below one verification: the first call to run out gets a timeout verdict and
    # its actor is restarted; the other candidate in flight there is re-sent with no attempt counted,
    # then runs out on its own
    pool = VerifierPool.remote(VerifyConfig(workers=2), RewardConfig(), 1, 0.0, 0.2)
    try:
        wait_for_pool(pool, lambda s: s["serving"] == 1, what="a serving actor")
        items = [("t0", relu, relu.solution_src), ("t1", relu, relu.solution_src)]
        verdicts = ray.get(pool.verify_batch.remote(items), timeout=120)
        assert [v.candidate_id for v in verdicts] == ["t0", "t1"]
        assert all(v.verdict == "timeout" and "actor restarted" in v.reason for v in verdicts)
        status = wait_for_pool(pool, lambda s: s["serving"] == 1, what="the restarted actor serving")
        assert status["completed"] == status["submitted"] == 2
        assert status["actors"][0]["restarts"] == 2 and status["actors"][0]["failures"] == 2
    finally:
        ray.kill(pool)
