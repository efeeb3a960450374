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

Each group keeps the behaviour log-probs the sampler recorded with the weights that sampled it;
TraceRL's ratio uses them, so stale samples are importance-weighted against their own behaviour
policy (the PPO clip bounds the step from it). The ``coupled`` and ``diffu_grpo`` estimators score
states the sampler never saw and recompute their "old" log-probs under the learner's current
weights: with stale samples their ratio starts at 1 and nothing corrects for the lag (the trainer
prints a warning when such a run asks for ``max_staleness > 0``).

Like slime's and OpenRLHF's async modes, this lives in the object it changes: :class:`StepPipeline`
owns the batches in flight; the trainer's loop keeps its shape.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import ray

from dice_ray.cluster.metrics import Interval, StageTimeline
from dice_ray.tasks.task import Task


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

    def results(self) -> list:
        """The calls' results in order (after :meth:`done`).

        Raises:
            the first failed call's exception (``ray.exceptions.RayTaskError`` / ``RayActorError``).
        """
        return [f.result() for f in self.futures]

    @property
    def seconds(self) -> float:
        """Submission to the last result (s); up to now while in flight."""
        end = self.interval.end if self.interval.end is not None else time.perf_counter()
        return end - self.interval.start


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
        step: the RL step the scheduler drew it for.
        infill_fraction, phase, requests: as :meth:`PhaseSchedule.next_batch` returned them.
        schedule: the scheduler's state just before this batch was drawn (what a checkpoint taken
            while it is in flight saves, so a resume draws it again).
        version: weights version the rollout workers held when it was launched.
        rollout: the ``generate`` calls, one a worker with prompts.
        groups: the sampled groups, once the rollout is done and checked.
        lags: ``step - weights_version`` of each group.
        verify: the ``verify_batch`` call, once launched.
    """

    step: int
    infill_fraction: float
    phase: str
    requests: list
    schedule: dict
    version: int
    rollout: Flight
    groups: list | None = None
    lags: list[int] = field(default_factory=list)
    verify: Flight | None = None


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
        rollout_workers: :class:`RolloutWorker` handles (a step's prompts are dealt round-robin).
        pool: the :class:`VerifierPool` handle.
        tasks: the run's tasks by id.
        num_generations: samples a prompt (``rl.num_generations``).
        max_staleness: ``rl.max_staleness`` (0: synchronous).
        first_step: the step the run starts (or resumes) at.
        last_step: ``rl.steps``; nothing is launched for a step at or past it.
        timeline: where stage intervals go.

    Raises:
        ValueError: a negative ``max_staleness``.
    """

    def __init__(
        self, scheduler, rollout_workers: list, pool, tasks: dict[str, Task], num_generations: int,
        max_staleness: int, first_step: int, last_step: int, timeline: StageTimeline,
    ):
        if max_staleness < 0:
            raise ValueError(f"rl.max_staleness={max_staleness}: must be >= 0")
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
        """Wait for ``batch``'s rollout; its groups, staleness-checked."""
        self._wait(batch.rollout.done)
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
        step, frac, phase, requests = ray.get(self.scheduler.next_batch.remote())
        n = len(self.rollout_workers)
        shards = [requests[i::n] for i in range(n)]
        refs = [w.generate.remote(s, self.num_generations) for w, s in zip(self.rollout_workers, shards) if s]
        rollout = Flight(refs, self.timeline.add("rollout", start), self._wake)
        self.pending.append(Batch(step, frac, phase, requests, schedule, version, rollout))
        self.next_step = step + 1

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
        for b in self.pending:
            if b.verify is None and b.rollout.done():
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
