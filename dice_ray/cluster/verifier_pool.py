"""The verifier pool: N verifier actors (one a GPU, or CPU compile-only actors), one queue.

Every submitted candidate id gets exactly one :class:`~dice_ray.verify.verdict.Verdict`:

- each verifier actor is a threaded Ray actor running ``VerifyConfig.workers`` candidates at once
  (its :class:`~dice_ray.verify.verifier.Verifier` has that many sandbox workers); the pool keeps
  up to that many candidates in flight on it, so one GPU actor stays busy;
- work on an actor that dies is re-sent to another (Ray restarts the dead one). A candidate that was
  in flight when its actor died is re-sent *alone* (no other candidate in flight on that actor), so a
  second death is its own: it then gets a ``crash`` verdict naming that (``MAX_ATTEMPTS``);
- a call that gives no verdict within ``call_timeout_s`` is a ``timeout`` verdict and its actor is
  restarted; the other candidates in flight there are re-sent with no attempt counted;
- scaling down drains: a draining actor takes no new work and is stopped once its in-flight
  candidates have their verdicts;
- each actor is placed by :func:`~dice_ray.cluster.placement.verifier_placement` (``cluster.placement``): a GPU
  verifier in ``pack`` gets a placement group of one bundle, made with its slot and removed when the slot
  retires, fails or the pool closes; in ``spread`` Ray's SPREAD actor scheduling. A slot whose actor is not
  placed (and answering) within ``cluster.placement_timeout_s`` fails, with an error naming what it asked and the
  cluster's resources (:meth:`VerifierPool.status`'s ``errors``).

The pool is a named async actor (:data:`POOL_NAME` in :data:`NAMESPACE`) so ``dice-ray verifiers
scale N`` / ``status`` can act on it from outside the job. With ``ClusterConfig.verifier_autoscale``
one periodic coroutine resizes it by queue depth between ``min_verifiers`` and ``max_verifiers``.
Dispatch after NeMo-RL's environment pools and OpenRLHF's actor groups.

Ray gauges exported by the pool actor (sampled each second, the spares every
:data:`SANDBOX_TICKS` seconds; tag ``pool``):

=======================================  =========================================================
``dice_ray_verifier_pool_queue``         candidates waiting in the pool's queue
``dice_ray_verifier_pool_in_flight``     candidates sent to verifier actors, no verdict yet
``dice_ray_verifier_pool_actors``        verifier actors serving or starting (not draining)
``dice_ray_verifier_pool_draining``      verifier actors finishing their last candidates
``dice_ray_verifier_pool_spares_ready``  spare sandbox workers ready, over the serving actors
``dice_ray_verifier_pool_promoted``      sandbox worker replacements that found no ready spare
=======================================  =========================================================
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
import time
import uuid
from dataclasses import dataclass, field

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from dice_ray.cluster.placement import PLACEMENT_TIMEOUT_S, RolePlacement, unplaced, verifier_placement
from dice_ray.config import ClusterConfig, RewardConfig, VerifyConfig
from dice_ray.tasks.task import Task
from dice_ray.verify.verdict import Verdict

POOL_NAME = "dice-ray-verifier-pool"
NAMESPACE = "dice-ray"
MAX_ATTEMPTS = 2
"""Actor deaths a candidate may be in flight for; the second gives it a ``crash`` verdict."""
TICK_S = 1.0
"""Period of the pool's gauge/autoscaling coroutine (s)."""
SANDBOX_TICKS = 5
"""Ticks between two polls of the actors' sandbox counters for the spares gauges."""
READY_PING_S = 5.0
"""Wait for one readiness ping of a starting verifier actor (s); repeated until it answers or drains."""
STATUS_PING_S = 2.0
"""Wait for an actor's sandbox counters (``info``) in :meth:`VerifierPool.status` before leaving them out (s)."""
SANDBOX_KEYS = ("workers", "restarts", "spares", "spares_ready", "promoted", "reference_facts", "gpu_gate_s")
"""An actor's sandbox counters in :meth:`VerifierPool.status` (``actors[].sandbox``; :meth:`Verifier.stats`'s keys)."""
RETIRE_CLOSE_S = 30.0
"""Wait for a drained actor to stop its sandbox workers before it is killed (s)."""


@ray.remote(max_restarts=-1, max_task_retries=0, num_cpus=0, concurrency_groups={"control": 1, "prepare": 1})
class VerifierActor:
    """One verifier on one GPU (or on CPU in compile-only mode); wraps :class:`~dice_ray.verify.verifier.Verifier`.

    A threaded actor: create it with ``.options(max_concurrency=actor_workers(verify_cfg, gpu))`` so that many
    :meth:`verify` calls run at once (``Verifier.verify`` is safe to call from several threads).
    :meth:`info` and :meth:`close` run in their own concurrency group, so they answer while every
    verify thread is busy.
    """

    def __init__(self, verify_cfg: VerifyConfig, reward_cfg: RewardConfig):
        from dice_ray.verify.verifier import Verifier

        gpu_ids = ray.get_gpu_ids()
        if not gpu_ids:  # no GPU granted by Ray: never touch one that happens to be on the node
            verify_cfg = verify_cfg.model_copy(update={"mode": "compile_only"})
        self.verifier = Verifier(verify_cfg, reward_cfg, device=0 if gpu_ids else None)
        self.node = ray.util.get_node_ip_address()
        self.gpu = [str(g) for g in gpu_ids]
        self.incarnation = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._lock = threading.Lock()
        self.done = 0
        self.in_flight = 0

    def verify(self, task: Task, candidate_src: str, candidate_id: str) -> Verdict:
        with self._lock:
            self.in_flight += 1
        try:
            return self.verifier.verify(task, candidate_src, candidate_id)
        finally:
            with self._lock:
                self.in_flight -= 1
                self.done += 1

    @ray.method(concurrency_group="prepare")
    def prepare(self, tasks: list[Task]) -> dict:
        """Measure the tasks' reference facts ahead of their candidates (:meth:`Verifier.prepare
        <dice_ray.verify.verifier.Verifier.prepare>`, its summary); in its own concurrency group, beside
        every verify thread."""
        return self.verifier.prepare(tasks)

    @ray.method(concurrency_group="control")
    def info(self) -> dict:
        """Where it runs and what it did: node, gpu, mode, workers, incarnation (pid + nonce), done, in_flight,
        and ``sandbox``: its sandbox workers (:meth:`Verifier.stats <dice_ray.verify.verifier.Verifier.stats>`'s
        ``workers``, ``restarts``, ``spares``, ``spares_ready``, ``promoted``, ``reference_facts``, ``gpu_gate_s``)."""
        with self._lock:
            done, in_flight = self.done, self.in_flight
        stats = self.verifier.stats()
        return {
            "node": self.node, "gpu": self.gpu, "mode": self.verifier.mode,
            "workers": getattr(self.verifier, "workers", None), "incarnation": self.incarnation,
            "done": done, "in_flight": in_flight,
            "sandbox": {k: stats[k] for k in SANDBOX_KEYS},
        }

    @ray.method(concurrency_group="control")
    def close(self) -> None:
        """Stop the sandbox workers (before the pool kills a drained actor)."""
        self.verifier.close()


@dataclass
class _Slot:
    """The pool's book-keeping for one verifier actor.

    ``room`` holds ``capacity`` permits, one per candidate in flight; a candidate re-sent after an
    actor death takes all of them (it runs alone). ``epoch`` counts the actor's incarnations as the
    pool saw them; ``pool_killed`` holds the epochs the pool itself ended (timeouts).
    """

    index: int
    handle: ray.actor.ActorHandle
    capacity: int
    room: asyncio.Semaphore
    ready: asyncio.Event
    placement: RolePlacement  # where its actor goes (a group of its own for a GPU verifier in pack), removed with it
    created: float = field(default_factory=time.monotonic)
    state: str = "starting"  # starting | serving | restarting | draining | failed
    draining: bool = False
    incarnation: str | None = None
    node: str | None = None
    gpu: list = field(default_factory=list)
    epoch: int = 0
    pool_killed: set = field(default_factory=set)
    in_flight: int = 0
    done: int = 0
    failures: int = 0
    restarts: int = 0
    busy_s: float = 0.0
    call_s: float = 0.0
    busy_since: float | None = None
    in_flight_at_drain: int = 0
    done_after_drain: int = 0
    error: str | None = None
    prepared: dict | None = None  # the summary of its last VerifierActor.prepare (VerifierPool.prepare)
    feeder: asyncio.Task | None = field(default=None, repr=False)
    calls: set = field(default_factory=set, repr=False)

    def busy_seconds(self, now: float) -> float:
        return self.busy_s + (now - self.busy_since if self.busy_since is not None else 0.0)

    def row(self, now: float) -> dict:
        age = max(now - self.created, 1e-9)
        return {
            "index": self.index, "state": self.state, "node": self.node, "gpu": self.gpu,
            "capacity": self.capacity, "in_flight": self.in_flight, "done": self.done,
            "failures": self.failures, "restarts": self.restarts,
            "busy_s": round(self.busy_seconds(now), 2),
            "utilization": round(self.call_s / (self.capacity * age), 3),
            "draining": self.draining, "in_flight_at_drain": self.in_flight_at_drain,
            "done_after_drain": self.done_after_drain, "error": self.error, "prepared": self.prepared,
            "group": self.placement.group.id.hex() if self.placement.group is not None else None,
        }


@dataclass
class _Item:
    candidate_id: str
    task: Task
    source: str
    future: asyncio.Future
    attempts: int = 0
    alone: bool = False  # re-sent after an actor death: runs with nothing else in flight on its actor


@ray.remote(num_cpus=0, max_concurrency=1000)
class VerifierPool:
    """Named async actor dispatching candidates to verifier actors.

    Args:
        verify_cfg, reward_cfg: passed to every verifier actor; :func:`actor_workers` candidates
            are kept in flight per actor.
        num_actors: initial pool size (clamped into the autoscaling bounds when autoscaling).
        gpus_per_actor: Ray GPUs a verifier actor asks for (0: CPU compile-only actors).
        call_timeout_s: an actor call longer than this (its own compile and run limits plus slack,
            and the wait for the GPU timing lock behind the actor's other workers) is a ``timeout``
            verdict, and the actor is restarted.
        cluster_cfg: its ``verifier_autoscale``, ``min_verifiers``, ``max_verifiers``,
            ``verifier_target_queue`` and ``verifier_scale_cooldown_s`` turn on and shape
            autoscaling, its ``placement`` and ``placement_timeout_s`` place the actors; None: fixed size
            (``scale`` only), ``pack``, :data:`~dice_ray.cluster.placement.PLACEMENT_TIMEOUT_S`.
        name: tag value of the pool's Ray gauges.
    """

    def __init__(
        self,
        verify_cfg: VerifyConfig,
        reward_cfg: RewardConfig,
        num_actors: int,
        gpus_per_actor: float,
        call_timeout_s: float,
        cluster_cfg: ClusterConfig | None = None,
        name: str = POOL_NAME,
    ):
        self.verify_cfg = verify_cfg
        self.reward_cfg = reward_cfg
        self.gpus_per_actor = gpus_per_actor
        self.call_timeout_s = call_timeout_s
        self.capacity = actor_workers(verify_cfg, gpu=gpus_per_actor > 0)
        self.name = name
        self.queue: asyncio.Queue[_Item] = asyncio.Queue()
        self.slots: list[_Slot] = []
        self.retired: list[dict] = []
        self.errors: list[str] = []
        self.next_index = 0
        self.submitted = 0
        self.completed = 0
        self.started = time.monotonic()
        self._mode = "gpu" if gpus_per_actor > 0 else "compile_only"
        self.placement = cluster_cfg.placement if cluster_cfg is not None else "pack"
        self.placement_timeout_s = cluster_cfg.placement_timeout_s if cluster_cfg is not None else PLACEMENT_TIMEOUT_S
        self._loop_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()  # every coroutine the pool started; close() ends them all
        self._closed = False
        self._last_change = time.monotonic()
        self._oversized_since: float | None = None
        self._batch: dict = {}
        self._prepare_tasks: list[Task] = []  # prepare(): every actor measures their reference facts
        self.autoscale: dict | None = None
        if cluster_cfg is not None and cluster_cfg.verifier_autoscale:
            hi = cluster_cfg.max_verifiers
            if hi is None:
                gpus = ray.cluster_resources().get("GPU", 0.0) if gpus_per_actor > 0 else 0.0
                hi = int(gpus // gpus_per_actor) if gpus else num_actors
            hi = max(hi, cluster_cfg.min_verifiers)
            self.autoscale = {
                "min": cluster_cfg.min_verifiers, "max": hi,
                "target_queue": cluster_cfg.verifier_target_queue,
                "cooldown_s": cluster_cfg.verifier_scale_cooldown_s,
            }
            num_actors = min(max(num_actors, self.autoscale["min"]), hi)
        self._target = num_actors
        self._gauges = _make_gauges()

    # -- life cycle of verifier actors ---------------------------------------------------------
    def _spawn(self, coro) -> asyncio.Task:
        """Run ``coro`` as a task of the pool's loop, kept in ``_tasks`` until it ends (for :meth:`close`)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _ensure_started(self) -> None:
        if self._loop_task is None and not self._closed:
            self._loop_task = self._spawn(self._tick_loop())
            if not self.slots and self._target:
                self._resize(self._target)

    def _active(self) -> list[_Slot]:
        return [s for s in self.slots if not s.draining]

    def _new_slot(self) -> _Slot:
        placement = verifier_placement(self.gpus_per_actor, self.placement)
        handle = VerifierActor.options(max_concurrency=self.capacity, **placement.options(0)).remote(
            self.verify_cfg, self.reward_cfg)
        slot = _Slot(
            index=self.next_index, handle=handle, capacity=self.capacity,
            room=asyncio.Semaphore(self.capacity), ready=asyncio.Event(), placement=placement,
        )
        self.next_index += 1
        slot.feeder = self._spawn(self._feed(slot))
        return slot

    def _resize(self, n: int) -> None:
        """Start actors up to ``n`` serving ones, or drain the surplus (starting and idle ones first)."""
        active = self._active()
        while len(active) < n:
            slot = self._new_slot()
            self.slots.append(slot)
            active.append(slot)
        surplus = sorted(active, key=lambda s: (s.state == "serving", s.in_flight, -s.index))[: len(active) - n]
        for slot in surplus:
            slot.draining = True
            slot.state = "draining"
            slot.in_flight_at_drain = slot.in_flight
            self._spawn(self._retire(slot))
        self._last_change = time.monotonic()
        self._oversized_since = None

    async def _retire(self, slot: _Slot) -> None:
        """Wait for the slot's feeder and in-flight calls, stop its workers, kill the actor."""
        if slot.feeder is not None:
            await slot.feeder
        while slot.calls:
            await asyncio.gather(*list(slot.calls), return_exceptions=True)
        if slot.state == "failed":  # _fail_slot did the book-keeping
            self._release(slot)
            return
        if slot.ready.is_set():
            try:
                await asyncio.wait_for(slot.handle.close.remote(), timeout=RETIRE_CLOSE_S)
            except Exception:  # noqa: BLE001, S110 - a dead or hung actor is killed below anyway
                pass
        self._release(slot)
        slot.state = "retired"
        if slot in self.slots:
            self.slots.remove(slot)
        self.retired.append(slot.row(time.monotonic()))
        del self.retired[:-32]

    def _release(self, slot: _Slot) -> None:
        """Kill the slot's actor (for good) and remove its placement group."""
        ray.kill(slot.handle, no_restart=True)
        slot.placement.remove()

    async def _wait_ready(self, slot: _Slot, old: str | None) -> None:
        """Ping the actor until an incarnation other than ``old`` answers; then it may take work.

        A new actor (``old`` None) must be placed within ``placement_timeout_s``: its group ready, where it has one,
        else (no group: placed by Ray's scheduling, which says nothing) its first answer; past that the slot fails
        with :func:`~dice_ray.cluster.placement.unplaced`'s message and its actor and group go."""
        group = slot.placement.group if old is None else None
        deadline = time.monotonic() + self.placement_timeout_s if old is None and group is None else math.inf
        if group is not None:
            try:
                await asyncio.wait_for(group.ready(), timeout=self.placement_timeout_s)
            except asyncio.TimeoutError:
                self._unplaced(slot)
                return
        while slot.state not in ("retired", "failed") and not slot.draining and not self._closed:
            if time.monotonic() > deadline:
                self._unplaced(slot)
                return
            try:
                info = await asyncio.wait_for(slot.handle.info.remote(), timeout=READY_PING_S)
            except asyncio.TimeoutError:
                continue
            except RayActorError as exc:
                if "creation task" in str(exc):  # __init__ raised: Ray will not restart it
                    self._fail_slot(slot, f"verifier actor {slot.index} could not start: {_first_line(exc)}")
                    return
                await asyncio.sleep(0.5)
                continue
            if old is not None and info["incarnation"] == old:
                await asyncio.sleep(0.5)
                continue
            slot.incarnation, slot.node, slot.gpu = info["incarnation"], info["node"], info["gpu"]
            if not slot.draining:
                slot.state = "serving"
            slot.ready.set()
            if self._prepare_tasks:  # a new actor, or one Ray restarted: its facts book starts empty
                slot.prepared = None
                self._spawn(self._prepare(slot))
            return

    async def _prepare(self, slot: _Slot) -> None:
        """One actor's :meth:`VerifierActor.prepare` over the tasks :meth:`prepare` was given; its summary
        goes to the slot's status row (an actor that dies meanwhile is prepared again once restarted)."""
        try:
            slot.prepared = await slot.handle.prepare.remote(self._prepare_tasks)
        except Exception as exc:  # noqa: BLE001 - a dead actor is restarted and prepared by _wait_ready
            slot.prepared = {"error": _first_line(exc)}

    def _unplaced(self, slot: _Slot) -> None:
        """Fail a slot whose actor was not placed (or did not answer) in time; its actor and group go."""
        p = slot.placement
        asks = p.bundles or [{"GPU": p.gpus[0], "CPU": p.cpus[0]}]
        how = p.strategy + (" group" if p.group is not None else " scheduling") if p.strategy else "default scheduling"
        self._fail_slot(slot, str(unplaced(f"verifier actor {slot.index}", asks, how, self.placement_timeout_s)))

    def _fail_slot(self, slot: _Slot, message: str) -> None:
        self._release(slot)
        slot.state, slot.error = "failed", message
        slot.draining = True
        self.errors.append(message)
        del self.errors[:-8]
        slot.ready.set()  # release the feeder: it sees the failed state and stops
        if slot in self.slots:
            self.slots.remove(slot)
        self.retired.append(slot.row(time.monotonic()))
        self._starved()

    def _starved(self) -> None:
        """No actor left to serve (all failed to start): give what waits a verdict instead of hanging."""
        if self._active():
            return
        reason = f"no verifier actor could start: {self.errors[-1] if self.errors else 'pool is empty'}"
        while not self.queue.empty():
            item = self.queue.get_nowait()
            self._resolve(item, _pool_verdict(item, self._mode, "crash", reason))

    def _lost(self, slot: _Slot, *, by_pool: bool) -> None:
        """The actor of ``slot`` died (or the pool killed it): stop dispatch until it is back."""
        if by_pool:
            slot.pool_killed.add(slot.epoch)
        slot.epoch += 1
        slot.restarts += 1
        slot.ready.clear()
        if not slot.draining:
            slot.state = "restarting"
        self._spawn(self._wait_ready(slot, slot.incarnation))

    # -- dispatch ------------------------------------------------------------------------------
    async def _take(self, slot: _Slot) -> _Item | None:
        """The next queued candidate, or None once the slot drains (checked every 0.5 s)."""
        while not slot.draining and not self._closed:
            if not self.queue.empty():
                return self.queue.get_nowait()
            getter = asyncio.ensure_future(self.queue.get())
            try:
                done, _ = await asyncio.wait({getter}, timeout=0.5)
            except asyncio.CancelledError:  # close(): leave no queue.get() pending in the loop
                getter.cancel()
                try:
                    self.queue.put_nowait(await getter)  # it took an item before the cancel: keep it
                except asyncio.CancelledError:
                    pass
                raise
            if not done:
                getter.cancel()
            try:
                item = await getter  # also when it completed while being cancelled: never drop an item
            except asyncio.CancelledError:
                continue
            if slot.draining:  # began draining while waiting: the item goes back to the others
                self.queue.put_nowait(item)
                return None
            return item
        return None

    async def _feed(self, slot: _Slot) -> None:
        """Keep up to ``capacity`` candidates in flight on the slot's actor until it drains."""
        await self._wait_ready(slot, None)
        # _closed checks: asyncio.wait_for (Python < 3.12) can swallow close()'s cancel
        while not slot.draining and not self._closed:
            await slot.room.acquire()
            while not (slot.ready.is_set() or slot.draining or self._closed):  # restarting: let the others serve
                try:
                    await asyncio.wait_for(slot.ready.wait(), timeout=0.5)
                except asyncio.TimeoutError:
                    pass
            item = None if slot.draining or self._closed else await self._take(slot)
            if item is None:
                slot.room.release()
                break
            permits = 1
            if item.alone:
                try:
                    for _ in range(slot.capacity - 1):  # wait for the others on this actor; take no new ones
                        await slot.room.acquire()
                except asyncio.CancelledError:  # close(): the item goes back, close() gives it its verdict
                    self.queue.put_nowait(item)
                    raise
                permits = slot.capacity
            if slot.draining or not slot.ready.is_set() or slot.state == "failed":
                self.queue.put_nowait(item)  # lost or draining its actor meanwhile: back to the others
                for _ in range(permits):
                    slot.room.release()
                continue
            # counted in flight before the call task runs, so a drain sees it (in_flight_at_drain)
            t0 = time.monotonic()
            if slot.in_flight == 0:
                slot.busy_since = t0
            slot.in_flight += 1
            call = self._spawn(self._call(slot, item, permits, t0))
            slot.calls.add(call)
            call.add_done_callback(slot.calls.discard)

    async def _call(self, slot: _Slot, item: _Item, permits: int, t0: float) -> None:
        """Send one candidate to the slot's actor; resolve it, or put it back in the queue.

        The feeder has counted it in ``slot.in_flight`` and taken ``permits`` of ``slot.room``;
        both are given back here.
        """
        epoch = slot.epoch
        item.attempts += 1
        try:
            ref = slot.handle.verify.remote(item.task, item.source, item.candidate_id)
            verdict = await asyncio.wait_for(ref, timeout=self.call_timeout_s)
        except (asyncio.TimeoutError, GetTimeoutError):
            if slot.epoch == epoch:  # the first call to run out on this incarnation: its candidate hung it
                slot.failures += 1
                self._lost(slot, by_pool=True)
                ray.kill(slot.handle, no_restart=False)
                self._resolve(item, _pool_verdict(
                    item, self._mode, "timeout",
                    f"verifier actor gave no verdict within {self.call_timeout_s:g} s; actor restarted"))
            else:  # the actor was restarted under it for another candidate
                self._requeue(item, counted=False)
        except RayActorError as exc:  # ActorDiedError, or ActorUnavailableError from an actor restarting
            if epoch in slot.pool_killed:  # the pool killed the actor for another candidate's timeout
                self._requeue(item, counted=False)
            else:
                if slot.epoch == epoch:
                    slot.failures += 1
                    self._lost(slot, by_pool=False)
                if item.attempts >= MAX_ATTEMPTS:
                    self._resolve(item, _pool_verdict(
                        item, self._mode, "crash",
                        f"verifier actor died {item.attempts} times with this candidate in flight "
                        f"(the last time alone): {type(exc).__name__}"))
                else:
                    self._requeue(item, counted=True)
        except asyncio.CancelledError:  # close() with this candidate in flight: no caller waits forever
            self._resolve(item, _pool_verdict(item, self._mode, "crash", "verifier pool closed with this candidate in flight"))
            raise
        except Exception as exc:  # noqa: BLE001 - the verifier itself raised: retry elsewhere, then a verdict
            slot.failures += 1
            if item.attempts >= MAX_ATTEMPTS:
                self._resolve(item, _pool_verdict(
                    item, self._mode, "crash", f"verifier raised on this candidate {item.attempts} times: {_first_line(exc)}"))
            else:
                self._requeue(item, counted=True)
        else:
            if self._resolve(item, verdict):
                slot.done += 1
                if slot.draining:
                    slot.done_after_drain += 1
        finally:
            now = time.monotonic()
            slot.in_flight -= 1
            slot.call_s += now - t0
            if slot.in_flight == 0 and slot.busy_since is not None:
                slot.busy_s += now - slot.busy_since
                slot.busy_since = None
            for _ in range(permits):
                slot.room.release()

    def _requeue(self, item: _Item, *, counted: bool) -> None:
        """Put ``item`` back; an attempt not ``counted`` is given back. Counted ones run alone next time."""
        if item.future.done():
            return
        if counted:
            item.alone = True
        else:
            item.attempts -= 1
        self.queue.put_nowait(item)

    def _resolve(self, item: _Item, verdict: Verdict) -> bool:
        if item.future.done():
            return False
        item.future.set_result(verdict)
        self.completed += 1
        return True

    # -- periodic: gauges and autoscaling ------------------------------------------------------
    async def _tick_loop(self) -> None:
        ticks = 0
        while not self._closed:
            try:
                self._tick()
                if self._gauges and ticks % SANDBOX_TICKS == 0:
                    await self._sandbox_gauges()
            except Exception as exc:  # noqa: BLE001 - never let the pool's clock die
                self.errors.append(f"tick: {_first_line(exc)}")
                del self.errors[:-8]
            ticks += 1
            await asyncio.sleep(TICK_S)

    async def _sandbox_gauges(self) -> None:
        """Set the spares gauges from the serving actors' sandbox counters (those that answer)."""
        boxes = [b for b in await asyncio.gather(*(self._sandbox(s) for s in self.slots)) if b]
        if boxes:
            tags = {"pool": self.name}
            for key in ("spares_ready", "promoted"):
                self._gauges[key].set(float(sum(b[key] for b in boxes)), tags=tags)

    def _tick(self) -> None:
        queued = self.queue.qsize()
        in_flight = sum(s.in_flight for s in self.slots)
        active = self._active()
        if self._batch:
            self._batch["peak_queue_depth"] = max(self._batch["peak_queue_depth"], queued)
            self._batch["peak_in_flight"] = max(self._batch["peak_in_flight"], in_flight)
        if self._gauges:
            tags = {"pool": self.name}
            for key, value in (("queue", queued), ("in_flight", in_flight), ("actors", len(active)),
                               ("draining", len(self.slots) - len(active))):
                self._gauges[key].set(float(value), tags=tags)
        if self.autoscale is not None:
            self._autoscale(queued, in_flight, len(active))

    def _autoscale(self, queued: int, in_flight: int, size: int) -> None:
        """Size wanted: enough actors for ``target_queue`` waiting candidates each, and for the work in
        flight; within [min, max]. Grow after the cool-down; shrink once over-sized for the cool-down."""
        a = self.autoscale
        want = max(math.ceil(queued / a["target_queue"]), math.ceil(in_flight / self.capacity))
        want = min(max(want, a["min"]), a["max"])
        now = time.monotonic()
        if want < size:
            self._oversized_since = self._oversized_since or now
        else:
            self._oversized_since = None
        if now - self._last_change < a["cooldown_s"]:
            return
        if want > size or (want < size and now - self._oversized_since >= a["cooldown_s"]):
            self._resize(want)

    # -- public API ----------------------------------------------------------------------------
    async def verify_batch(self, items: list[tuple[str, Task, str]]) -> list[Verdict]:
        """Verify ``[(candidate_id, task, source), ...]``; returns one verdict each, in order.

        Raises:
            ValueError: a candidate id appears twice in the batch.
            RuntimeError: the pool was closed (:meth:`close`).
        """
        ids = [cid for cid, _, _ in items]
        if len(set(ids)) != len(ids):
            raise ValueError("verify_batch: candidate ids must be unique within a batch")
        if self._closed:
            raise RuntimeError("verify_batch: the verifier pool is closed")
        await self._ensure_started()
        loop = asyncio.get_running_loop()
        pending = []
        for cid, task, src in items:
            item = _Item(candidate_id=cid, task=task, source=src, future=loop.create_future())
            self.queue.put_nowait(item)
            pending.append(item.future)
        self.submitted += len(items)
        self._starved()
        t0 = time.monotonic()
        self._batch = {"n": len(items), "peak_queue_depth": self.queue.qsize(), "peak_in_flight": 0}
        verdicts = list(await asyncio.gather(*pending))
        self._batch["seconds"] = round(time.monotonic() - t0, 3)
        return verdicts

    async def prepare(self, tasks: list[Task]) -> None:
        """Have every verifier actor measure the reference facts of ``tasks`` in the background
        (:meth:`Verifier.prepare <dice_ray.verify.verifier.Verifier.prepare>`), and each actor started or
        restarted later too; returns at once.  The trainer calls it at start with the tasks of the run, so
        their first groups find the facts measured (while the learner warm-starts the verifiers are idle)."""
        await self._ensure_started()
        self._prepare_tasks = list(tasks)
        for slot in self._active():
            if slot.ready.is_set():
                self._spawn(self._prepare(slot))

    async def scale(self, n: int) -> dict:
        """Grow or shrink to ``n`` actors now; shrinking lets in-flight candidates finish first.

        With autoscaling on, the autoscaler resumes after its cool-down (within its bounds). Returns
        :meth:`status` with ``scaled_from``: the target size before this call (``n`` itself: nothing changed).

        Raises:
            ValueError: ``n`` is not an integer >= 1.
            RuntimeError: the pool was closed (:meth:`close`).
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"verifier pool size must be an integer >= 1, got {n!r}")
        if self._closed:
            raise RuntimeError("scale: the verifier pool is closed")
        await self._ensure_started()
        before, self._target = self._target, n
        self._resize(n)
        return {**await self.status(), "scaled_from": before}

    async def close(self) -> None:
        """End every coroutine the pool started, stop its verifier actors' sandbox workers, then remove the slots'
        placement groups (their actors go with them).

        Call it (and wait for it) before the pool actor is killed or its handle dropped: a task still
        pending when the actor's event loop closes is destroyed there, and its clean-up prints
        ``Task was destroyed but it is pending!`` and ``RuntimeError: Event loop is closed``.
        Candidates still queued or in flight get a ``crash`` verdict saying the pool closed; later
        :meth:`verify_batch` calls raise, :meth:`status` still answers. Calling it again is a no-op
        but for the sandbox workers' close.
        """
        self._closed = True
        while self._tasks:  # a cancelled task may have started another one before it saw the cancel
            tasks = list(self._tasks)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._tasks.difference_update(tasks)
        while not self.queue.empty():
            item = self.queue.get_nowait()
            self._resolve(item, _pool_verdict(item, self._mode, "crash", "verifier pool closed before this candidate ran"))
        await asyncio.gather(*(slot.handle.close.remote() for slot in self.slots), return_exceptions=True)
        for slot in self.slots:  # their actors go with their groups; a closed pool verifies nothing more
            slot.placement.remove()

    async def actors(self) -> list:
        """Handles of the serving verifier actors (for fault-injection tests and debugging)."""
        return [s.handle for s in self.slots if not s.draining]

    async def _sandbox(self, slot: _Slot) -> dict | None:
        """A serving actor's sandbox counters (``info()["sandbox"]``); None if it is not serving or does not
        answer within :data:`STATUS_PING_S`."""
        if slot.state != "serving":
            return None
        try:
            info = await asyncio.wait_for(slot.handle.info.remote(), timeout=STATUS_PING_S)
        except Exception:  # noqa: BLE001 - a dying or busy actor: its row says so, the counters are left out
            return None
        return info.get("sandbox")

    async def status(self) -> dict:
        """Pool size, queue depth, throughput, per-actor counters, autoscaling and recent errors.

        Keys: ``size`` (actors not draining, starting ones included), ``serving``, ``draining``,
        ``queue_depth``, ``in_flight``, ``capacity_per_actor``, ``submitted``, ``completed``,
        ``throughput_per_s`` (since the pool started), ``last_batch`` (n, seconds, peak queue depth,
        peak in flight of the latest ``verify_batch``), ``autoscale`` (None or its bounds),
        ``actors`` (one row each: state, in_flight, done, failures, restarts, busy_s, utilization,
        draining counters, ``group``: the id of its placement group, None without one; ``prepared``: the summary of
        its last :meth:`prepare`, None before one; ``sandbox``:
        the serving actor's sandbox workers, replacements, spares, spares ready, replacements that found no
        ready spare (``promoted``), references whose facts it keeps (``reference_facts``) and GPU gate seconds, None
        when it did not answer within :data:`STATUS_PING_S`), ``spares`` / ``spares_ready`` /
        ``promoted`` (summed over the actors that answered; None when none did), ``retired`` (rows of
        actors drained and stopped), ``errors``.
        """
        await self._ensure_started()
        sandboxes = await asyncio.gather(*(self._sandbox(s) for s in self.slots))
        now = time.monotonic()
        elapsed = max(now - self.started, 1e-9)
        active = self._active()
        rows = [{**s.row(now), "sandbox": box} for s, box in zip(self.slots, sandboxes)]
        boxes = [b for b in sandboxes if b]
        return {
            "size": len(active),
            "serving": sum(1 for s in active if s.state == "serving"),
            "draining": len(self.slots) - len(active),
            "queue_depth": self.queue.qsize(),
            "in_flight": sum(s.in_flight for s in self.slots),
            "capacity_per_actor": self.capacity,
            "mode": self._mode,
            "submitted": self.submitted,
            "completed": self.completed,
            "throughput_per_s": self.completed / elapsed,
            "last_batch": dict(self._batch),
            "autoscale": dict(self.autoscale) if self.autoscale else None,
            "actors": rows,
            **{k: sum(b[k] for b in boxes) if boxes else None for k in ("spares", "spares_ready", "promoted")},
            "retired": list(self.retired),
            "errors": list(self.errors),
        }


def actor_workers(verify_cfg: VerifyConfig, gpu: bool) -> int:
    """Candidates one verifier actor runs at once: ``VerifyConfig.workers``, or its auto value (0:
    ``AUTO_GPU_WORKERS`` of :mod:`dice_ray.verify.verifier` on a GPU, 1 compile-only)."""
    if verify_cfg.workers:
        return verify_cfg.workers
    if not gpu:
        return 1
    from dice_ray.verify import verifier

    return int(getattr(verifier, "AUTO_GPU_WORKERS", 6))


def _make_gauges() -> dict:
    try:
        from ray.util.metrics import Gauge

        return {
            key: Gauge(f"dice_ray_verifier_pool_{key}", description=desc, tag_keys=("pool",))
            for key, desc in (
                ("queue", "candidates waiting in the verifier pool's queue"),
                ("in_flight", "candidates sent to verifier actors, no verdict yet"),
                ("actors", "verifier actors serving or starting"),
                ("draining", "verifier actors finishing their last candidates"),
                ("spares_ready", "spare sandbox workers ready, over the serving actors"),
                ("promoted", "sandbox worker replacements that found no ready spare"),
            )
        }
    except Exception:  # noqa: BLE001 - metrics are optional (e.g. no metrics agent)
        return {}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:500]


def _pool_verdict(item: _Item, mode: str, verdict: str, reason: str) -> Verdict:
    return Verdict(
        candidate_id=item.candidate_id,
        task_id=item.task.task_id,
        verdict=verdict,
        compiled=False,
        correct=None,
        speedup=None,
        reward=0.0,
        reason=reason,
        mode=mode,
        seconds=0.0,
    )
