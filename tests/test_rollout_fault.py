"""A killed rollout worker costs nothing but time (issue 6): restarted, re-synced, its prompts re-sampled.

:class:`StepPipeline` on a local Ray cluster with restartable stand-in workers whose samples spell out the
weights version that made them and the prompt's seed: a worker that crashes mid-``generate`` (synchronous
and one step ahead), one killed while idle, and one that never stops crashing. ``dice-ray train`` with a real
worker crashing mid-step (the :data:`~dice_ray.cluster.rollout.FAULT_ENV` hook) is tests/test_resume_exact.py's.
Every test that starts Ray is ``slow`` (each restart spawns a process: 10-25 s a test on 2 shared cores).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import ray

from dice_ray.cluster.metrics import StageTimeline
from dice_ray.cluster.pipeline import StepPipeline, recoverable
from dice_ray.cluster.rollout import GroupRollout, WeightsMissing
from dice_ray.cluster.scheduler import PhaseSchedulerActor
from dice_ray.cluster.weight_sync import WeightSync
from dice_ray.config import PhaseConfig
from _helpers import joined_ray


# ---- StepPipeline and WeightSync with restartable stand-in workers --------------------------------------------
@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class CrashingRollout:
    """A stand-in rollout worker: its candidates are ``"w{weights}:s{seed}:{j}"``. It crashes (``os._exit``)
    on its ``die_on``-th ``generate`` call once (a marker file remembers it across restarts), or on every
    call with ``die_on=-1``; it appends each ``set_weights`` version to ``log``."""

    def __init__(self, marker: str, die_on: int = 0, log: str = ""):
        self.marker, self.die_on, self.log = marker, die_on, log
        self.version, self.weights, self.calls = -1, None, 0

    def ping(self):
        return self.version

    def set_weights(self, weights, version):  # a broadcast spec: the group generation joined stands for the weights
        self.weights = weights["w"] if isinstance(weights, dict) else f"g{weights.generation}"
        self.version = version
        if self.log:
            with open(self.log, "a") as f:
                f.write(f"{version}\n")
        return version

    def set_version(self, version):
        if self.version >= 0:
            self.version = version
        return self.version

    def generate(self, requests, g, tasks):
        assert set(tasks) == {r.task_id for r in requests}  # the call carries exactly its requests' tasks
        self.calls += 1
        if self.die_on == -1 or (self.calls == self.die_on and not os.path.exists(self.marker)):
            Path(self.marker).touch()
            time.sleep(0.05)
            os._exit(1)
        if self.version < 0:
            raise WeightsMissing("no weights")
        time.sleep(0.05)
        return [GroupRollout(r, [], [f"w{self.weights}:s{r.seed}:{j}" for j in range(g)], 4, 0.0, self.version)
                for r in requests]


class FakeLearner:
    """The learner side of the object-store sync: its weights are its version."""

    def __init__(self):
        self.current = 0

    def weights_ref(self):
        return ray.put({"w": self.current})


@ray.remote(num_cpus=0, max_concurrency=4)
class EchoPool:
    def verify_batch(self, items):
        return [name for name, _, _ in items]


@pytest.fixture(scope="module")
def cluster(ray_head):
    with joined_ray(ray_head, namespace="dice-ray-test-rollout-fault"):
        pool = EchoPool.remote()
        ray.get(pool.verify_batch.remote([]))
        yield pool


def _wait_restarted(worker, timeout_s: float = 60.0) -> None:
    """``ray.kill`` returns at once: wait until the restarted (empty, version -1) process answers, so the
    next call meets the new process and not the dying one."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if ray.get(worker.ping.remote(), timeout=5) == -1:
                return
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        assert time.monotonic() < deadline, "the killed worker did not come back"
        time.sleep(0.1)


def _run(pool, tmp: Path, max_staleness: int, die_on: dict[int, int], steps: int = 4, kill_idle_at: int | None = None,
         queued: bool = False):
    """The trainer's loop with stand-ins and 2 workers: per step (candidates, lags, restarts), and each
    worker's set_weights log. Checks every step's candidates are those of its prompts' seeds and the
    weights version its batch was launched with: what a run without failures samples. ``queued``: the
    asynchronous trainer's object-store path (pushes queued behind the rollouts ahead, a lane a step)."""
    tmp.mkdir()
    tasks = [(f"t{i}", 1) for i in range(5)]
    scheduler = PhaseSchedulerActor.remote([], tasks, PhaseConfig(), 3, 0)
    logs = [tmp / f"log{i}" for i in range(2)]
    workers = [CrashingRollout.remote(str(tmp / f"marker{i}"), die_on.get(i, 0), str(logs[i])) for i in range(2)]
    learner = FakeLearner()
    sync = WeightSync(learner, workers, "object_store", keep_versions=max_staleness + 1)
    sync.push(0)
    pipe = StepPipeline(scheduler, workers, pool, {t: None for t, _ in tasks}, 2, max_staleness, 0, steps,
                        StageTimeline(), weight_sync=sync, lanes=2 if queued else 1)
    out = []
    for step in range(steps):
        if step == kill_idle_at:
            ray.kill(workers[1], no_restart=False)  # dies between steps, holding nothing in flight
            _wait_restarted(workers[1])
        batch = pipe.take(learner.current)
        groups = pipe.groups(batch)
        assert [g.request for g in groups] == (batch.requests if queued else
                                               [r for i in range(2) for r in batch.requests[i::2]])
        assert [c for g in groups for c in g.candidates] == [
            f"w{batch.version}:s{g.request.seed}:{j}" for g in groups for j in range(2)]
        assert pipe.verdicts(batch) == [f"{g.request.request_id}-g{j}" for g in groups for j in range(2)]
        learner.current = step + 1
        if not queued:
            pipe.drain_rollouts()
        pushed = sync.push(learner.current, wait=not queued)
        out.append(([c for g in groups for c in g.candidates], batch.lags, batch.restarts + pushed["restarts"]))
    assert ray.get([w.ping.remote() for w in workers]) == [steps, steps]  # after every queued push: the last one
    for w in workers:
        ray.kill(w, no_restart=True)
    return out, [[int(x) for x in p.read_text().split()] for p in logs]


@pytest.mark.slow
@pytest.mark.parametrize("max_staleness", [0, 1])
def test_a_worker_crashing_mid_generate_is_resampled_with_its_batchs_weights(cluster, tmp_path, max_staleness):
    crash, logs = _run(cluster, tmp_path / "crash", max_staleness, {1: 3})  # worker 1's 3rd call: step 2's shard
    # _run checked the samples are those of a run without the crash; the lags are too
    assert [lag for _, lag, _ in crash] == ([[0] * 3] * 4 if max_staleness == 0 else [[0] * 3] + [[1] * 3] * 3)
    restarts = [r for _, _, r in crash]  # one step ahead, step 1's push may meet the worker restarting too
    assert restarts == [0, 0, 1, 0] if max_staleness == 0 else restarts[0] == 0 and restarts[2] == 1 and not restarts[3]
    launched = 2 - max_staleness  # the weights version step 2's batch was launched with
    assert all(c.startswith(f"w{launched}:") for c in crash[2][0])
    # the restarted worker is re-synced to that version (one step ahead: after the push of version 2 it got)
    assert logs == [[0, 1, 2, 3, 4], [0, 1, 2, launched, 3, 4]]


@pytest.mark.slow
def test_queued_pushes_and_lanes_resample_a_crashed_shard_with_its_batchs_weights(cluster, tmp_path):
    # worker 1 samples the odd steps; its 2nd generate is step 3's batch, launched at step 2 with version 2
    crash, logs = _run(cluster, tmp_path / "queued", 1, {1: 2}, steps=5, queued=True)  # _run checked the samples
    assert [lag for _, lag, _ in crash] == [[0] * 3] + [[1] * 3] * 4
    assert crash[3][2] >= 1 and all(c.startswith("w2:") for c in crash[3][0])
    # re-synced to its batch's version 2 after the crash, and the later queued pushes reached it in order
    assert logs[1][:3] == [0, 1, 2] and logs[1].count(2) == 2 and logs[1][-2:] == [4, 5]
    assert logs[0] == [0, 1, 2, 3, 4, 5]


@pytest.mark.slow
def test_a_worker_killed_between_steps_is_resynced_before_it_samples(cluster, tmp_path):
    killed, logs = _run(cluster, tmp_path / "idle", 0, {}, kill_idle_at=2)  # _run checked the samples
    assert [r for _, _, r in killed][:2] == [0, 0] and killed[2][2] >= 1
    assert logs[1][:3] == [0, 1, 2] and logs[1].count(2) == 2  # version 2 pushed, then again after the restart


@pytest.mark.slow
def test_a_shard_that_keeps_crashing_stops_the_run_with_its_name(cluster, tmp_path):
    tasks = [("t0", 1), ("t1", 1)]
    scheduler = PhaseSchedulerActor.remote([], tasks, PhaseConfig(), 2, 0)
    workers = [CrashingRollout.remote(str(tmp_path / "m"), -1)]
    sync = WeightSync(FakeLearner(), workers, "object_store")
    sync.push(0)
    pipe = StepPipeline(scheduler, workers, cluster, {"t0": None, "t1": None}, 2, 0, 0, 2, StageTimeline(),
                        weight_sync=sync, max_shard_failures=2)
    batch = pipe.take(0)
    with pytest.raises(RuntimeError, match=r"step 0: rollout worker 0's shard \(\[.+\]\) failed 2 times in a row"):
        pipe.groups(batch)
    assert batch.restarts == 1
    ray.kill(workers[0], no_restart=True)
    with pytest.raises(ValueError, match="max_shard_failures"):
        StepPipeline(scheduler, workers, cluster, {}, 2, 0, 0, 2, StageTimeline(), max_shard_failures=0)


@pytest.mark.slow
def test_resync_resends_a_kept_version_or_else_the_last_one(cluster, tmp_path):
    log = tmp_path / "log"
    w = CrashingRollout.remote(str(tmp_path / "m"), 0, str(log))
    learner = FakeLearner()
    sync = WeightSync(learner, [w], "object_store", keep_versions=2)
    with pytest.raises(RuntimeError, match="before any push"):
        sync.resync(0, 0)
    for v in range(3):
        learner.current = v
        sync.push(v)
    assert sorted(sync.kept) == [1, 2]
    assert sync.resync(0, 1) == 1 and ray.get(w.ping.remote()) == 1  # exact: the kept ref of version 1
    assert sync.resync(0, 0) == 2  # no longer kept: the last pushed version, and the worker says so
    assert log.read_text().split() == ["0", "1", "2", "1", "2"]
    with pytest.raises(ValueError, match="keep_versions"):
        WeightSync(learner, [w], "object_store", keep_versions=0)
    ray.kill(w, no_restart=True)


@pytest.mark.slow
def test_a_step_without_an_update_relabels_the_weights_held_and_sends_nothing(cluster, tmp_path):
    """relabel: the workers call the weights they hold by the new version (no set_weights, nothing read from the
    learner); a worker restarted since the last push gets the last pushed weights under the new version; the kept
    refs cover the new version, so a resync of it is exact."""
    logs = [tmp_path / f"log{i}" for i in range(2)]
    workers = [CrashingRollout.remote(str(tmp_path / f"m{i}"), 0, str(logs[i])) for i in range(2)]
    learner = FakeLearner()
    sync = WeightSync(learner, workers, "object_store", keep_versions=2)
    assert sync.relabel(0)["restarts"] == 0  # before any push: a push
    learner.current = 7  # were the learner read, the workers would now hold "7"
    report = sync.relabel(1)
    assert report["relabel"] and report["bytes"] == 0 and report["restarts"] == 0
    state = lambda w: ray.get(w.__ray_call__.remote(lambda self: (self.version, self.weights)))  # noqa: E731
    assert [state(w) for w in workers] == [(1, 0), (1, 0)]
    assert sync.kept[1] == sync.kept[0]
    ray.kill(workers[1], no_restart=False)  # comes back empty
    _wait_restarted(workers[1])
    assert sync.relabel(2)["restarts"] == 1
    assert [state(w) for w in workers] == [(2, 0), (2, 0)]
    assert [p.read_text().split() for p in logs] == [["0"], ["0", "2"]]  # set_weights: the first push, the empty one
    assert sync.resync(0, 1) == 1 and state(workers[0]) == (1, 0)
    sync.relabel(3, wait=False)  # queued behind rollouts, as the asynchronous trainer does
    assert ray.get([w.ping.remote() for w in workers]) == [3, 3]
    for w in workers:
        ray.kill(w, no_restart=True)


class FakeBroadcastLearner:
    """The learner side of the broadcast sync, less the collectives."""

    def rendezvous(self):
        return "127.0.0.1", 0

    def plan_buckets(self, bucket_bytes):
        return ()

    def broadcast_weights(self, spec):
        return []


@pytest.mark.slow
def test_broadcast_forms_a_new_group_for_a_restarted_worker(cluster, tmp_path):
    workers = [CrashingRollout.remote(str(tmp_path / f"m{i}"), 0, str(tmp_path / f"log{i}")) for i in range(2)]
    sync = WeightSync(FakeBroadcastLearner(), workers, "broadcast")
    assert sync.push(0)["restarts"] == 0 and sync.push(1)["restarts"] == 0
    assert sync.spec.generation == 0
    ray.kill(workers[1], no_restart=False)  # dies between steps: comes back empty, cannot join group 0
    _wait_restarted(workers[1])
    assert sync.push(2)["restarts"] == 1 and sync.spec.generation == 1
    assert ray.get([w.__ray_call__.remote(lambda self: (self.version, self.weights)) for w in workers]) == [(2, "g1")] * 2
    # a broadcast cannot resend version 1: a new group, the last pushed version, to every worker
    assert sync.resync(1, 1) == 2 and sync.spec.generation == 2
    assert [(tmp_path / f"log{i}").read_text().split() for i in range(2)] == [["0", "1", "2", "2"], ["0", "1", "2", "2"]]
    # a step without an update: nothing broadcast, unless a worker came back empty (then a new group, a full push)
    assert sync.relabel(3)["restarts"] == 0 and sync.spec.generation == 2
    ray.kill(workers[0], no_restart=False)
    _wait_restarted(workers[0])
    assert sync.relabel(4)["restarts"] == 1 and sync.spec.generation == 3
    assert [(tmp_path / f"log{i}").read_text().split()[4:] for i in range(2)] == [["4"], ["4"]]
    assert ray.get([w.ping.remote() for w in workers]) == [4, 4]
    with pytest.raises(ValueError, match="wait=False"):
        sync.relabel(5, wait=False)
    for w in workers:
        ray.kill(w, no_restart=True)


def test_only_worker_deaths_and_missing_weights_are_recovered():
    assert recoverable(ray.exceptions.ActorDiedError()) and recoverable(ray.exceptions.ActorUnavailableError("x", b"0" * 16))
    assert recoverable(WeightsMissing("restarted"))
    assert not recoverable(KeyError("task")) and not recoverable(ray.exceptions.GetTimeoutError())
