"""The asynchronous step pipeline (issue 6): the staleness bound, stage timings, busy shares.

Unit tests of the interval arithmetic, the staleness check and the GPU sampler; and :class:`StepPipeline` on a
local Ray cluster with stand-in actors of known durations (the overlap and the lags are known exactly).
``dice-ray train`` with ``rl.max_staleness=1`` end to end, then ``--resume``, is ``tests/test_train_e2e.py``'s job;
``max_staleness=0`` keeping the synchronous metrics is ``tests/test_resume_exact.py``'s.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import ray
from hypothesis import given, settings
from hypothesis import strategies as st

from dice_ray.cluster.metrics import STAGES, GpuBusySampler, StageTimeline, intersect, merge, total
from dice_ray.cluster.pipeline import StepPipeline, check_staleness, staleness_stats
from dice_ray.cluster.rollout import GroupRollout
from dice_ray.cluster.scheduler import PhaseSchedulerActor, PromptRequest
from dice_ray.config import PhaseConfig, load_config
from _helpers import joined_ray


# ---- the staleness bound ------------------------------------------------------------------------------
def _group(rid: str, version: int) -> GroupRollout:
    return GroupRollout(PromptRequest(rid, "t", "e2e", 0), [], ["src", "src"], 4, 0.1, version)


def test_staleness_bound_accepts_lags_within_it_and_names_the_rest():
    assert check_staleness([_group("a", 5), _group("b", 4)], step=5, max_staleness=1) == [0, 1]
    with pytest.raises(RuntimeError, match=r"\('b', 3\).*rl.max_staleness=1: versions 4..5"):
        check_staleness([_group("a", 5), _group("b", 3)], step=5, max_staleness=1)
    with pytest.raises(RuntimeError, match="'a'"):  # synchronous: one version old is already too old
        check_staleness([_group("a", 4)], step=5, max_staleness=0)
    with pytest.raises(RuntimeError, match="'a'"):  # weights from the future: a pipeline bug
        check_staleness([_group("a", 6)], step=5, max_staleness=2)
    assert staleness_stats([0, 1, 1, 0]) == {"staleness_max": 1, "staleness_mean": 0.5}


def test_max_staleness_is_a_checked_config_knob():
    assert load_config(None, []).rl.max_staleness == 0
    assert load_config(None, ["rl.max_staleness=2"]).rl.max_staleness == 2
    with pytest.raises(ValueError, match="max_staleness"):
        load_config(None, ["rl.max_staleness=-1"])


# ---- the timeline: busy shares, idle, overlap ------------------------------------------------------------
def test_window_clips_intervals_and_counts_in_flight_calls_to_its_end():
    tl = StageTimeline()
    tl.add("rollout", 0.0, 4.0)   # starts before the window
    tl.add("learn", 3.0, 6.0)
    tl.add("verify", 5.0, 7.0)
    tl.add("rollout", 8.0)        # still in flight at the window's end
    w = tl.window(2.0, 10.0)
    assert w["timeline"] == {"rollout": [[0.0, 2.0], [6.0, 8.0]], "verify": [[3.0, 5.0]], "learn": [[1.0, 4.0]], "sync": []}
    assert w["rollout_busy_share"] == pytest.approx(4 / 8) and w["learner_busy_share"] == pytest.approx(3 / 8)
    assert w["verify_busy_share"] == pytest.approx(2 / 8)
    assert w["idle_seconds"] == pytest.approx(1.0)             # [7, 8]: nothing in flight
    assert w["rollout_learn_overlap_seconds"] == pytest.approx(1.0)  # [3, 4]
    # ended intervals are dropped; the one in flight carries into the next window
    assert tl.window(10.0, 12.0)["timeline"]["rollout"] == [[0.0, 2.0]]
    with pytest.raises(ValueError, match="stage 'eval'"):
        tl.add("eval", 0.0)
    with pytest.raises(ValueError, match="end must be after start"):
        tl.window(3.0, 3.0)


spans = st.lists(st.tuples(st.sampled_from(STAGES), st.floats(0, 10), st.floats(0, 5)), max_size=12)


@settings(max_examples=60, deadline=None)
@given(spans)
def test_window_figures_agree_with_a_brute_force_count(items):
    tl = StageTimeline()
    for stage, start, length in items:
        tl.add(stage, start, start + length)
    t0, t1 = 1.0, 9.0
    w = tl.window(t0, t1)
    cell = 4e-3
    grid = [t0 + (i + 0.5) * cell for i in range(2000)]

    def busy(stage, t):
        return any(s == stage and a <= t < a + n for s, a, n in items)

    inside = {stage: sum(busy(stage, t) for t in grid) * cell for stage in STAGES}
    tol = 2 * cell * (len(items) + 1)  # each interval end may miscount one cell
    assert w["rollout_busy_share"] * 8 == pytest.approx(inside["rollout"], abs=tol)
    assert w["learner_busy_share"] * 8 == pytest.approx(inside["learn"], abs=tol)
    idle = sum(not any(busy(s, t) for s in STAGES) for t in grid) * cell
    assert w["idle_seconds"] == pytest.approx(idle, abs=tol)
    both = sum(busy("rollout", t) and busy("learn", t) for t in grid) * cell
    assert w["rollout_learn_overlap_seconds"] == pytest.approx(both, abs=tol)


def test_interval_helpers():
    assert merge([(3, 4), (0, 1), (0.5, 2), (5, 5)]) == [(0, 2), (3, 4)]
    assert intersect([(0, 2), (3, 4)], [(1, 3.5)]) == [(1, 2), (3, 3.5)]
    assert total([(0, 2), (3, 4)]) == 3


# ---- GPU busy share -----------------------------------------------------------------------------------
def test_gpu_sampler_averages_each_gpus_samples_within_the_window():
    s = GpuBusySampler(read=lambda: [0.25, 1.0], interval_s=0.01).start()
    t0 = time.perf_counter()
    time.sleep(0.15)
    shares = s.window(t0, time.perf_counter())
    s.stop()
    assert shares == {"0": pytest.approx(0.25), "1": pytest.approx(1.0)}
    assert s.window(time.perf_counter(), time.perf_counter() + 1) is None  # no sample in that window
    default = GpuBusySampler(interval_s=0.01).start()  # NVML's reader, or none on a machine without GPUs
    time.sleep(0.05)
    if default.read is None:
        assert default.window(0.0, time.perf_counter()) is None
    default.stop()
    with pytest.raises(ValueError, match="interval_s"):
        GpuBusySampler(read=lambda: [0.0], interval_s=0)


# ---- StepPipeline on Ray with stand-in actors of known durations ---------------------------------------
ROLLOUT_S, VERIFY_S, LEARN_S = 0.4, 0.1, 0.6


@ray.remote(num_cpus=0)
class FakeRollout:
    def __init__(self):
        self.version = 0

    def set_weights(self, version):
        self.version = version

    def generate(self, requests, g, tasks):
        time.sleep(ROLLOUT_S)
        return [GroupRollout(r, [], ["src"] * g, 4, ROLLOUT_S, self.version) for r in requests]


@ray.remote(num_cpus=0, max_concurrency=8)
class FakePool:
    def verify_batch(self, items):
        time.sleep(VERIFY_S)
        return [SimpleNamespace(reward=1.0) for _ in items]


@ray.remote(num_cpus=0)
class FakeLearner:
    def train_step(self, n):
        time.sleep(LEARN_S)
        return {"groups": n}


@pytest.fixture(scope="module")
def stand_ins(ray_head):
    """Started stand-in actors on the shared local Ray cluster: (rollout worker, verifier pool, learner)."""
    with joined_ray(ray_head, namespace="dice-ray-test-pipeline"):
        actors = FakeRollout.remote(), FakePool.remote(), FakeLearner.remote()
        ray.get([actors[0].set_weights.remote(0), actors[1].verify_batch.remote([]), actors[2].train_step.remote(0)])
        yield actors


def _loop(actors, max_staleness: int, steps: int = 4):
    """The trainer's step loop with stand-ins: (per-step (lags, window), scheduler steps saved, seconds)."""
    tasks = [(f"t{i}", 1) for i in range(3)]
    scheduler = PhaseSchedulerActor.remote([], tasks, PhaseConfig(), 2, 0)
    worker, pool, learner = actors
    ray.get([worker.set_weights.remote(0), scheduler.get_state.remote()])
    tl = StageTimeline()
    pipe = StepPipeline(scheduler, [worker], pool, {t: None for t, _ in tasks}, 2, max_staleness, 0, steps, tl)
    version, out, saved = 0, [], []
    t_start = time.perf_counter()
    for step in range(steps):
        t0 = time.perf_counter()
        batch = pipe.take(version)
        assert batch.step == step
        pipe.groups(batch)
        assert len(pipe.verdicts(batch)) == 2 * 2
        learned = pipe.wait(pipe.submit("learn", [learner.train_step.remote(len(batch.groups))]))
        assert learned == [{"groups": 2}]
        version = step + 1
        pipe.drain_rollouts()
        ray.get(worker.set_weights.remote(version))
        saved.append((pipe.schedule_before(step + 1) or ray.get(scheduler.get_state.remote()))["step"])
        out.append((batch.lags, tl.window(t0, time.perf_counter())))
    return out, saved, time.perf_counter() - t_start


def test_resuming_scheduler_says_so_until_its_state_is_restored(stand_ins):
    """``dice-ray status`` early in a resumed run: the scheduler reports ``restoring`` (not the fresh
    schedule's step 0) until the trainer restores its state."""
    tasks = [(f"t{i}", 1) for i in range(3)]
    fresh = PhaseSchedulerActor.remote([], tasks, PhaseConfig(), 2, 0)
    resumed = PhaseSchedulerActor.remote([], tasks, PhaseConfig(), 2, 0, 0, True)
    assert ray.get(fresh.status.remote())["restoring"] is False
    assert ray.get(resumed.status.remote())["restoring"] is True
    ray.get(fresh.next_batch.remote())
    ray.get(resumed.set_state.remote(ray.get(fresh.get_state.remote())))
    status = ray.get(resumed.status.remote())
    assert status["restoring"] is False and status["schedule"]["step"] == 1


def test_pipeline_overlaps_rollout_with_learning_within_the_bound(stand_ins):
    sync, sync_saved, sync_s = _loop(stand_ins, 0)
    asyn, asyn_saved, asyn_s = _loop(stand_ins, 1)
    assert [lags for lags, _ in sync] == [[0, 0]] * 4
    assert [lags for lags, _ in asyn] == [[0, 0]] + [[1, 1]] * 3  # step t+1 sampled with the weights of step t
    assert all(w["rollout_learn_overlap_seconds"] == 0 for _, w in sync)
    overlap = [w["rollout_learn_overlap_seconds"] for _, w in asyn[:-1]]  # the last step has nothing ahead
    assert all(o > 0.2 for o in overlap), overlap  # the next rollout (0.4 s) runs inside the learner step (0.6 s)
    for _, w in asyn:  # the recorded overlap is the one the recorded intervals give
        tlv = {k: [tuple(iv) for iv in v] for k, v in w["timeline"].items()}
        assert total(intersect(tlv["rollout"], tlv["learn"])) == pytest.approx(w["rollout_learn_overlap_seconds"], abs=1e-3)
    assert asyn_s < sync_s - 0.6, (asyn_s, sync_s)
    # a checkpoint after step t saves the scheduler as it was before step t+1 was drawn
    assert sync_saved == asyn_saved == [1, 2, 3, 4]


# ---- queued weight pushes and rollout lanes -------------------------------------------------------------
LANE_ROLLOUT_S = 1.0  # far longer than verification and learning: only lanes let two rollouts overlap


@ray.remote(num_cpus=0)
class LaneRollout:
    """A rollout worker stand-in that logs each call: (kind, request ids or version, weights version, start, end)."""

    def __init__(self):
        self.version, self.log = None, []

    def set_weights(self, weights, version):
        t0 = time.perf_counter()
        assert weights == {"version": version}
        self.version = version
        self.log.append(("set_weights", version, version, t0, time.perf_counter()))
        return version

    def generate(self, requests, g, tasks):
        t0 = time.perf_counter()
        time.sleep(LANE_ROLLOUT_S)
        self.log.append(("generate", [r.request_id for r in requests], self.version, t0, time.perf_counter()))
        return [GroupRollout(r, [], ["src"] * g, 4, LANE_ROLLOUT_S, self.version) for r in requests]

    def calls(self):
        return self.log


class VersionedLearner:
    """The driver-side learner handle WeightSync needs: ``weights_ref`` of the current version's weights."""

    def __init__(self):
        self.version = 0

    def weights_ref(self):
        return ray.put({"version": self.version})


def test_queued_push_does_not_wait_for_the_rollout_ahead_but_runs_after_it(stand_ins):
    from dice_ray.cluster.weight_sync import WeightSync

    worker, learner = LaneRollout.remote(), VersionedLearner()
    sync = WeightSync(learner, [worker], "object_store", keep_versions=2)
    assert sync.push(0)["restarts"] == 0  # waits: the worker holds version 0
    ahead = worker.generate.remote([PromptRequest("r1", "t", "e2e", 0)], 2, {})
    time.sleep(0.2)  # the rollout is running
    learner.version = 1
    sync.push(1, wait=False)
    assert ray.wait([ahead], timeout=0)[1] == [ahead]  # the push returned with the rollout still running
    after = worker.generate.remote([PromptRequest("r2", "t", "e2e", 0)], 2, {})
    assert ray.get(ahead)[0].weights_version == 0  # launched before the push: the old weights
    assert ray.get(after)[0].weights_version == 1  # launched after it: the new ones
    assert [c[0] for c in ray.get(worker.calls.remote())] == ["set_weights", "generate", "set_weights", "generate"]
    assert sync.push(2, wait=False)["restarts"] == 0  # the queued call finished fine
    with pytest.raises(ValueError, match="object-store"):
        WeightSync(learner, [worker], "broadcast").push(3, wait=False)


def test_lanes_sample_steps_side_by_side_on_their_own_workers(stand_ins):
    from dice_ray.cluster.weight_sync import WeightSync

    _, pool, fake_learner = stand_ins
    workers, learner = [LaneRollout.remote() for _ in range(2)], VersionedLearner()
    tasks = [(f"t{i}", 1) for i in range(4)]
    scheduler = PhaseSchedulerActor.remote([], tasks, PhaseConfig(), 2, 0)
    sync = WeightSync(learner, workers, "object_store", keep_versions=2)
    sync.push(0)
    with pytest.raises(ValueError, match="lanes=3"):
        StepPipeline(scheduler, workers, pool, {}, 2, 1, 0, 5, StageTimeline(), lanes=3)
    pipe = StepPipeline(scheduler, workers, pool, {t: None for t, _ in tasks}, 2, 1, 0, 5, StageTimeline(),
                        weight_sync=sync, lanes=2)
    version, lags, request_steps = 0, [], {}
    for step in range(5):
        batch = pipe.take(version)
        request_steps.update({r.request_id: step for r in batch.requests})
        groups = pipe.groups(batch)
        pipe.verdicts(batch)
        pipe.wait(pipe.submit("learn", [fake_learner.train_step.remote(len(groups))]))
        version = learner.version = step + 1
        sync.push(version, wait=False)  # no drain: queued behind the rollout launched ahead
        lags.append(batch.lags)
    assert lags == [[0, 0]] + [[1, 1]] * 4  # launched one step ahead, each with the weights of its launch
    logs = ray.get([w.calls.remote() for w in workers])
    spans = []
    for lane, log in enumerate(logs):
        gens = [c for c in log if c[0] == "generate"]
        assert {request_steps[rid] % 2 for c in gens for rid in c[1]} == {lane}  # each step on its lane's worker
        spans.append([(c[3], c[4]) for c in gens])
    # the two lanes' rollouts ran side by side (each lasts 1 s; a step's own work takes ~0.7 s)
    overlap = total(intersect(merge(spans[0]), merge(spans[1])))
    assert overlap > 0.5, overlap
