"""The verifier pool on a real local Ray cluster: one verdict per candidate, even when a verifier
actor is killed mid-batch; live scale up and down; compile-only verdicts on CPU."""

import time

import pytest
import ray

from dice_ray.cluster.verifier_pool import VerifierPool
from dice_ray.config import RewardConfig, VerifyConfig
from dice_ray.tasks.loaders import load_tasks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, namespace="dice-ray-test", log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def relu():
    return next(t for t in load_tasks("builtin").tasks if t.name.endswith("relu"))


def _batch(task, n, prefix):
    broken = task.solution_src.replace("__global__", "__global__ oops", 1)
    return [(f"{prefix}{i}", task, task.solution_src if i % 2 == 0 else broken) for i in range(n)]


def test_exactly_one_verdict_per_candidate_despite_actor_death(cluster, relu):
    pool = VerifierPool.remote(VerifyConfig(), RewardConfig(), 2, 0.0, 120.0)
    ray.get(pool.scale.remote(2))
    items = _batch(relu, 10, "c")
    ref = pool.verify_batch.remote(items)
    time.sleep(1.0)
    # kill one verifier actor while the batch is in flight (Ray restarts it; its work is re-sent)
    victim = ray.get(pool.actors.remote())[0]
    ray.kill(victim, no_restart=False)
    verdicts = ray.get(ref, timeout=300)
    assert [v.candidate_id for v in verdicts] == [cid for cid, _, _ in items]
    assert all(v.mode == "compile_only" for v in verdicts)
    good = [v for v in verdicts if int(v.candidate_id[1:]) % 2 == 0]
    bad = [v for v in verdicts if int(v.candidate_id[1:]) % 2 == 1]
    assert all(v.verdict in ("ok", "crash") for v in good)
    assert sum(v.verdict == "ok" for v in good) >= 4
    assert all(v.verdict == "compile_error" and not v.compiled for v in bad if v.verdict != "crash")
    status = ray.get(pool.status.remote())
    assert status["completed"] == status["submitted"] == 10
    ray.kill(pool)


def test_scale_up_and_down_keeps_in_flight_work(cluster, relu):
    pool = VerifierPool.remote(VerifyConfig(), RewardConfig(), 1, 0.0, 120.0)
    assert ray.get(pool.scale.remote(1))["size"] == 1
    ref = pool.verify_batch.remote(_batch(relu, 6, "s"))
    assert ray.get(pool.scale.remote(2))["size"] == 2
    down = ray.get(pool.scale.remote(1))
    assert down["size"] == 1
    verdicts = ray.get(ref, timeout=300)
    assert len(verdicts) == 6 and len({v.candidate_id for v in verdicts}) == 6
    assert {v.verdict for v in verdicts} <= {"ok", "compile_error"}
    with pytest.raises(ray.exceptions.RayTaskError, match=">= 1"):
        ray.get(pool.scale.remote(0))
    ray.kill(pool)
