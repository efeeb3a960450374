"""The verifier pool's shutdown on a real local Ray cluster: ``close()`` ends every coroutine the
pool started, so the pool actor exits without asyncio's ``Task was destroyed but it is pending!`` /
``RuntimeError: Event loop is closed`` in its stderr (issue 7), and no caller waits forever on a
candidate the closed pool will never run."""

import os
import time
from pathlib import Path

import pytest
import ray

from dice_ray.cluster.verifier_pool import VerifierPool
from dice_ray.config import RewardConfig, VerifyConfig
from dice_ray.tasks.loaders import load_tasks
from _helpers import joined_ray, wait_for_pool

pytestmark = pytest.mark.slow

NOISE = ("Event loop is closed", "Task was destroyed but it is pending")


@pytest.fixture(scope="module")
def cluster(ray_head):
    with joined_ray(ray_head, namespace="dice-ray-test-shutdown"):
        yield


def _worker_of(handle) -> tuple[int, Path]:
    """The actor's pid and the file its stderr goes to (``logs/worker-<id>-<job>-<pid>.err``)."""
    worker_id, pid = ray.get(handle.__ray_call__.remote(lambda self: (ray.get_runtime_context().get_worker_id(), os.getpid())))
    ctx = ray.get_runtime_context()
    logs = Path(ctx.get_temp_dir()) / ctx.get_session_name() / "logs"
    found = list(logs.glob(f"worker-{worker_id}-*-{pid}.err"))
    assert len(found) == 1, (logs, worker_id, pid, found)
    return pid, found[0]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_close_leaves_nothing_pending_and_the_pool_exits_quietly(cluster):
    relu = next(t for t in load_tasks("builtin").tasks if t.name.endswith("relu"))
    pool = VerifierPool.remote(VerifyConfig(workers=1), RewardConfig(), 1, 0.0, 300.0)
    wait_for_pool(pool, lambda s: s["serving"] == 1, "a serving verifier actor", timeout=90.0, poll=0.1)
    items = [(f"c{i}", relu, relu.solution_src) for i in range(4)]
    ref = pool.verify_batch.remote(items)
    wait_for_pool(pool, lambda s: s["in_flight"] == 1 and s["queue_depth"] >= 1, "one candidate in flight, others queued", timeout=90.0, poll=0.1)

    ray.get(pool.close.remote(), timeout=60)
    # the batch is answered: one verdict each, those that did not run say the pool closed
    verdicts = ray.get(ref, timeout=30)
    assert [v.candidate_id for v in verdicts] == [cid for cid, _, _ in items]
    closed = [v for v in verdicts if v.verdict == "crash" and "verifier pool closed" in v.reason]
    assert len(closed) >= 1 and all(v.verdict == "ok" for v in verdicts if v not in closed), verdicts
    with pytest.raises(ray.exceptions.RayTaskError, match="pool is closed"):
        ray.get(pool.verify_batch.remote(items[:1]), timeout=30)
    assert ray.get(pool.__ray_call__.remote(lambda self: len(self._tasks))) == 0
    assert ray.get(pool.status.remote())["completed"] == len(items)  # status still answers, starts nothing

    # drop every handle: Ray ends the actor gracefully, closing its event loop (what a finished job does)
    pid, err = _worker_of(pool)
    del pool, ref
    deadline = time.monotonic() + 60
    while not _gone(pid):
        assert time.monotonic() < deadline, f"the pool actor (pid {pid}) did not exit"
        time.sleep(0.2)
    text = err.read_text()
    assert not [n for n in NOISE if n in text], text
