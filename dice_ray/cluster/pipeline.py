"""The step pipeline of ``dice-ray train``: rollout and verification run ahead of the learner, within a
staleness bound (issue 6).

With ``rl.max_staleness = s``, step ``t`` starts by launching the rollouts of steps up to ``t + s``
(prompts drawn from the phase scheduler, ``RolloutWorker.generate`` ObjectRefs submitted) before it
waits on anything, so they run while step ``t`` is verified and learned; a rollout found done while
the driver waits is sent to the verifier pool at once. The queue of batches launched ahead holds at
most ``s``. Rollout workers are plain (one-call-at-a-time) Ray actors, so a batch launched while the
workers hold weights version ``v`` (after ``v`` learner steps) is sampled with exactly ``v``: the
weight sync after step ``t`` queues behind it. A batch of step ``u`` launched at step ``t`` therefore
lags ``u - t <= s`` versions, which :func:`check_staleness` checks on every group. ``s = 0`` is the
synchronous loop (draw, sample, verify, learn, sync), call for call.

Through the object store the trainer does not wait for the rollouts launched ahead before it pushes the
new weights: the push is queued behind them on each worker (``WeightSync.push(wait=False)``). The workers
are then split into ``min(workers, s + 1)`` lanes and each step samples on its own lane, so up to ``s + 1``
steps are sampled side by side. A diffusion rollout lasts as many denoising steps as its longest sample
needs, however many workers share its prompts, so side-by-side steps are what more workers buy
(measured on 2 H200s with the tiny policy: 2 workers sharing each step's prompts cut the median rollout
only from 3.8 to 3.3 s).

Each group keeps the behaviour log-probs the sampler recorded with the weights that sampled it;
TraceRL's ratio uses them, so stale samples are importance-weighted against their own behaviour
policy (the PPO clip bounds the step from it). The ``coupled`` and ``diffu_grpo`` estimators score
states the sampler never saw and recompute their "old" log-probs under the learner's current
weights: with stale samples their ratio starts at 1 and nothing corrects for the lag (the trainer
prints a warning when such a run asks for ``max_staleness > 0``).

Like slime's and OpenRLHF's async modes, this lives in the object it changes: :class:`StepPipeline`
owns the batches in flight; the trainer's loop keeps its shape.

A rollout worker that dies costs only time (issue 6). Workers are restartable actors without task
retries (:mod:`dice_ray.cluster.rollout`); a ``generate`` call that fails because its worker died
(``RayActorError``: ``ActorDiedError`` / ``ActorUnavailableError``), or that reached a restarted worker
before it had weights (:class:`~dice_ray.cluster.rollout.WeightsMissing`), is recovered when the trainer
asks for the batch (:meth:`StepPipeline.groups`, where the learner is idle and holds the weights of the
last push): the pipeline waits for the worker to answer a ping, re-syncs it with the weights version the
batch was launched with (:meth:`WeightSync.resync <dice_ray.cluster.weight_sync.WeightSync.resync>`:
exact on the object store; a broadcast re-sends the last pushed version, whose lag the groups record)
and re-sends that worker's shard: the same requests, so the same ids and seeds, and since sampling is
seeded per prompt, the same samples as if it had not died. A shard that fails
``MAX_SHARD_FAILURES`` times in a row stops the run with an error naming it. Each batch counts its
recovered shards (``Batch.restarts``, the step record's ``rollout_restarts``).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import ray

from dice_ray.cluster.metrics import Interval, StageTimeline
from dice_ray.cluster.rollout import WeightsMissing, tasks_of, wait_until_alive
from dice_ray.cluster.scheduler import StepPlan
from dice_ray.tasks.task import Task

MAX_SHARD_FAILURES = 3
"""Consecutive failed ``generate`` calls of one batch's shard (its worker died each time) before the run
stops with an error."""


def recoverable(error: BaseException) -> bool:
    """Whether a failed ``generate`` call is one the pipeline re-sends: its worker died or was restarting
    (``RayActorError`` and its ``ActorDiedError`` / ``ActorUnavailableError``), or a restarted worker had
    no weights yet (:class:`~dice_ray.cluster.rollout.WeightsMissing`). A bug in sampling is not."""
    return isinstance(error, (ray.exceptions.RayActorError, WeightsMissing))


class Flight:
    """The Ray calls of one stage submitted together, followed as futures (``ObjectRef.future()``).

    A done-callback ends the stage's :class:`~dice_ray.cluster.metrics.Interval` when the last call's
    result is ready, and wakes whoever waits on ``wake``, so timings do not depend on when the driver
    looks.

    Args:
        refs: the calls' ObjectRefs (may be empty: done at once).
        interval: the timeline interval this flight ends.
        wake: condition notified (with ``events`` bumped) as each call finishes.
    """

    def __init__(self, refs: list, interval: Interval, wake: _Wake):
        self.interval = interval
        self.start = interval.start
        self._wake = wake
        self._left = len(refs)
        self._lock = threading.Lock()
        self.futures = [r.future() for r in refs]
        if not self.futures:
            interval.end = interval.start
        for f in self.futures:
            f.add_done_callback(self._one_done)

    def _one_done(self, _future) -> None:
        with self._lock:
            self._left -= 1
            if self._left == 0:
                self.interval.end = time.perf_counter()
        self._wake.bump()

    def done(self) -> bool:
        """Every call has finished (and the interval has its end)."""
        return self.interval.end is not None

    def errors(self) -> list[tuple[int, BaseException]]:
        """``(index, exception)`` of each finished call that failed, in order."""
        return [(j, f.exception()) for j, f in enumerate(self.futures) if f.done() and f.exception() is not None]

    def retry(self, calls: list[tuple[int, object]], interval: Interval) -> None:
        """Replace finished calls by new ones (re-sent after a failure); the flight is in flight again.

        Args:
            calls: ``(index, ObjectRef)`` of each replaced call.
            interval: the timeline interval of the retried calls (the first attempt's keeps its end).

        Raises:
            RuntimeError: the flight is still in flight (only a finished flight is retried).
        """
        if not self.done():
            raise RuntimeError("Flight.retry: calls still in flight")
        futures = [(j, ref.future()) for j, ref in calls]
        with self._lock:
            self.interval = interval
            self._left = len(futures)
            for j, f in futures:
                self.futures[j] = f
        for _, f in futures:
            f.add_done_callback(self._one_done)

    def results(self) -> list:
        """The calls' results in order (after :meth:`done`).

        Raises:
            the first failed call's exception (``ray.exceptions.RayTaskError`` / ``RayActorError``).
        """
        return [f.result() for f in self.futures]

    @property
    def seconds(self) -> float:
        """Submission to the last result (s), retries included; up to now while in flight."""
        end = self.interval.end if self.interval.end is not None else time.perf_counter()
        return end - self.start


class _Wake:
    """A condition with an event counter, so a waiter cannot miss a completion between check and wait."""

    def __init__(self):
        self.cond = threading.Condition()
        self.events = 0

    def bump(self) -> None:
        with self.cond:
            self.events += 1
            self.cond.notify_all()


@dataclass
class Batch:
    """One step's prompts on their way through rollout and verification.

    Attributes:
        plan: the :class:`~dice_ray.cluster.scheduler.StepPlan` the scheduler drew (step, infill fraction, stage,
            requests, the curriculum's decision).
        schedule: the scheduler's state just before this batch was drawn (what a checkpoint taken
            while it is in flight saves, so a resume draws it again).
        version: weights version the rollout workers held when it was launched.
        rollout: the ``generate`` calls, one a worker with prompts.
        shards: ``(worker index, requests)`` of each ``generate`` call, in the order of ``rollout``.
        groups: the sampled groups, once the rollout is done and checked.
        lags: ``step - weights_version`` of each group.
        verify: the ``verify_batch`` call, once launched.
        restarts: shards re-sent after their worker died.
        failures: consecutive failures of each shard.
    """

    plan: StepPlan
    schedule: dict
    version: int
    rollout: Flight
    shards: list[tuple[int, list]] = field(default_factory=list)
    groups: list | None = None
    lags: list[int] = field(default_factory=list)
    verify: Flight | None = None
    restarts: int = 0
    failures: dict[int, int] = field(default_factory=dict)

    @property
    def step(self) -> int:
        return self.plan.step

    @property
    def requests(self) -> list:
        return self.plan.requests


def check_staleness(groups: list, step: int, max_staleness: int) -> list[int]:
    """Lag of each group's weights behind ``step`` (``step - weights_version``), checked against the bound.

    Args:
        groups: :class:`~dice_ray.cluster.rollout.GroupRollout` (or anything with ``request.request_id``
            and ``weights_version``).
        step: the RL step the groups are trained in (fresh weights for it are version ``step``).
        max_staleness: ``rl.max_staleness``.

    Returns:
        the lags, in the order of ``groups``.

    Raises:
        RuntimeError: a group sampled with weights more than ``max_staleness`` versions old, or newer
            than the step (both are pipeline bugs, never expected).
    """
    lags = [step - g.weights_version for g in groups]
    bad = [(g.request.request_id, g.weights_version) for g, lag in zip(groups, lags) if not 0 <= lag <= max_staleness]
    if bad:
        raise RuntimeError(
            f"step {step}: rollouts {bad} (request, weights version) were sampled outside the bound "
            f"rl.max_staleness={max_staleness}: versions {step - max_staleness}..{step} allowed"
        )
    return lags


def verify_items(groups: list, tasks: dict[str, Task]) -> list[tuple[str, Task, str]]:
    """``VerifierPool.verify_batch`` items of ``groups``: ``(f"{request_id}-g{j}", task, candidate)``."""
    return [
        (f"{g.request.request_id}-g{j}", tasks[g.request.task_id], src)
        for g in groups
        for j, src in enumerate(g.candidates)
    ]


class StepPipeline:
    """Prompts -> rollouts -> verdicts for the trainer's steps, up to ``max_staleness`` steps ahead.

    Args:
        scheduler: the :class:`PhaseSchedulerActor` handle.
        rollout_workers: :class:`RolloutWorker` handles (a step's prompts are dealt round-robin over its lane's).
        pool: the :class:`VerifierPool` handle.
        tasks: the run's tasks by id.
        num_generations: samples a prompt (``rl.num_generations``).
        max_staleness: ``rl.max_staleness`` (0: synchronous).
        first_step: the step the run starts (or resumes) at.
        last_step: ``rl.steps``; nothing is launched for a step at or past it.
        timeline: where stage intervals go.
        weight_sync: the :class:`~dice_ray.cluster.weight_sync.WeightSync` that re-syncs a restarted
            worker; None: a failed ``generate`` call stops the run (no recovery).
        max_shard_failures: consecutive failures of one shard before giving up.
        lanes: the rollout workers split into this many lanes (worker ``i`` in lane ``i % lanes``); step
            ``u``'s prompts are dealt round-robin over lane ``u % lanes``. 1: every step over every worker.
            With weight pushes that do not wait for the rollouts ahead (:meth:`WeightSync.push`
            ``wait=False``), ``lanes = min(workers, max_staleness + 1)`` samples up to that many steps at
            once, each on its own workers: a rollout bound by its longest sample's denoising steps (not
            by the GPU) is not shortened by more workers, but several run side by side.

    Raises:
        ValueError: a negative ``max_staleness``, a ``max_shard_failures`` below 1, or ``lanes`` outside
            ``[1, len(rollout_workers)]``.
    """

    def __init__(
        self, scheduler, rollout_workers: list, pool, tasks: dict[str, Task], num_generations: int,
        max_staleness: int, first_step: int, last_step: int, timeline: StageTimeline,
        weight_sync=None, max_shard_failures: int = MAX_SHARD_FAILURES, lanes: int = 1,
    ):
        if max_staleness < 0:
            raise ValueError(f"rl.max_staleness={max_staleness}: must be >= 0")
        if max_shard_failures < 1:
            raise ValueError(f"max_shard_failures={max_shard_failures}: must be >= 1")
        if not 1 <= lanes <= max(1, len(rollout_workers)):
            raise ValueError(f"lanes={lanes}: must lie in [1, {len(rollout_workers)} rollout workers]")
        self.lanes = lanes
        self.weight_sync, self.max_shard_failures = weight_sync, max_shard_failures
        self.scheduler, self.rollout_workers, self.pool, self.tasks = scheduler, rollout_workers, pool, tasks
        self.num_generations = num_generations
        self.max_staleness = max_staleness
        self.next_step = first_step  # the next step to draw from the scheduler
        self.next_take = first_step  # the next step the trainer takes
        self.last_step = last_step
        self.timeline = timeline
        self.pending: deque[Batch] = deque()  # launched, not yet taken by the trainer; at most max_staleness
        self._wake = _Wake()

    # ---- the trainer's calls, in step order ----------------------------------------------------------
    def take(self, version: int) -> Batch:
        """The next step's batch, launched now (or earlier, ahead), after launching the steps after it up
        to ``max_staleness`` ahead (the bounded queue; none at or past ``last_step``).

        Args:
            version: the weights version the rollout workers hold now (the trainer's, after its sync).

        Raises:
            RuntimeError: the scheduler's step does not follow the trainer's (its state was changed
                behind the pipeline's back), or the run has no step left.
        """
        step = self.next_take
        while self.next_step <= min(step + self.max_staleness, self.last_step - 1):
            self._launch(version)
        batch = self.pending.popleft() if self.pending else None
        if batch is None or batch.step != step:
            raise RuntimeError(f"pipeline: the trainer wants step {step}, the scheduler drew {batch and batch.step}")
        self.next_take = step + 1
        return batch

    def groups(self, batch: Batch) -> list:
        """Wait for ``batch``'s rollout, re-sending the shards of workers that died (see the module notes);
        its groups, staleness-checked.

        Raises:
            RuntimeError: a shard failed ``max_shard_failures`` times in a row, or its worker did not come
                back; a sampling error (not a worker death) as it was raised.
        """
        while True:
            self._wait(batch.rollout.done)
            failed = batch.rollout.errors()
            if not failed or self.weight_sync is None or not all(recoverable(e) for _, e in failed):
                break  # done, or an error to raise as it is (_collect)
            self._recover(batch, failed)
        self._collect(batch)
        return batch.groups

    def verdicts(self, batch: Batch) -> list:
        """Verify ``batch`` (if not already launched) and wait for its verdicts, one a candidate, in order."""
        self._start_verify(batch)
        self._wait(batch.verify.done)
        return batch.verify.results()[0]

    def submit(self, stage: str, refs: list, start: float | None = None) -> Flight:
        """Follow calls the trainer submitted (the learner step) as a :class:`Flight` of ``stage``."""
        return Flight(refs, self.timeline.add(stage, time.perf_counter() if start is None else start), self._wake)

    def wait(self, flight: Flight) -> list:
        """Wait for ``flight`` while moving the batches ahead along; its results."""
        self._wait(flight.done)
        return flight.results()

    def drain_rollouts(self) -> None:
        """Wait for every rollout launched ahead (the weight sync queues behind them on the workers)."""
        self._wait(lambda: all(b.rollout.done() for b in self.pending))

    def schedule_before(self, step: int) -> dict | None:
        """The scheduler state to checkpoint before ``step``: the state before its batch was drawn if
        that batch is in flight (a resume re-draws and re-samples it), else None (the scheduler's own)."""
        return self.pending[0].schedule if self.pending and self.pending[0].step == step else None

    # ---- inside ------------------------------------------------------------------------------------
    def _launch(self, version: int) -> None:
        start = time.perf_counter()
        schedule = ray.get(self.scheduler.get_state.remote())
        plan = ray.get(self.scheduler.next_batch.remote())
        step, requests = plan.step, plan.requests
        lane = [i for i in range(len(self.rollout_workers)) if i % self.lanes == step % self.lanes]
        n = len(lane)
        shards = [(i, requests[k::n]) for k, i in enumerate(lane) if requests[k::n]]
        refs = [self.rollout_workers[i].generate.remote(s, self.num_generations, tasks_of(s, self.tasks)) for i, s in shards]
        rollout = Flight(refs, self.timeline.add("rollout", start), self._wake)
        self.pending.append(Batch(plan, schedule, version, rollout, shards))
        self.next_step = step + 1

    def _recover(self, batch: Batch, failed: list[tuple[int, BaseException]]) -> None:
        """Wait for the failed shards' workers, re-sync them to ``batch.version`` and re-send the shards."""
        calls = []
        for j, error in failed:
            i, requests = batch.shards[j]
            batch.failures[j] = batch.failures.get(j, 0) + 1
            if batch.failures[j] >= self.max_shard_failures:
                raise RuntimeError(
                    f"step {batch.step}: rollout worker {i}'s shard ({[r.request_id for r in requests]}) failed "
                    f"{batch.failures[j]} times in a row (max_shard_failures={self.max_shard_failures}); "
                    f"last error: {error!r}"
                ) from error
            worker = self.rollout_workers[i]
            wait_until_alive(worker)
            self.weight_sync.resync(i, batch.version)
            calls.append((j, worker.generate.remote(requests, self.num_generations, tasks_of(requests, self.tasks))))
            batch.restarts += 1
        batch.rollout.retry(calls, self.timeline.add("rollout", time.perf_counter()))

    def _collect(self, batch: Batch) -> None:
        if batch.groups is None:
            groups = [g for part in batch.rollout.results() for g in part]
            batch.lags = check_staleness(groups, batch.step, self.max_staleness)
            batch.groups = groups

    def _start_verify(self, batch: Batch) -> None:
        if batch.verify is None:
            self._collect(batch)
            start = time.perf_counter()
            ref = self.pool.verify_batch.remote(verify_items(batch.groups, self.tasks))
            batch.verify = Flight([ref], self.timeline.add("verify", start), self._wake)

    def _advance(self) -> None:
        """Send each batch ahead whose rollout is done to the verifier pool."""
        for b in self.pending:  # a failed rollout waits for groups() to recover it
            if b.verify is None and b.rollout.done() and not b.rollout.errors():
                self._start_verify(b)

    def _wait(self, ready) -> None:
        while True:
            with self._wake.cond:
                seen = self._wake.events
            self._advance()
            if ready():
                return
            with self._wake.cond:
                while self._wake.events == seen:
                    self._wake.cond.wait()


def staleness_stats(lags: list[int]) -> dict:
    """``staleness_max`` / ``staleness_mean`` of a step's group lags (0 / 0.0 with no groups)."""
    return {"staleness_max": max(lags, default=0), "staleness_mean": statistics.fmean(lags) if lags else 0.0}
