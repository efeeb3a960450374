"""The verifier pool: N verifier actors (one a GPU, or CPU compile-only actors), one queue.

Every submitted candidate id gets exactly one :class:`~dice_ray.verify.verdict.Verdict`: work on an
actor that dies is re-sent to another (Ray restarts the dead one), a candidate that kills actors
twice gets a ``crash`` verdict naming that, and scaling down lets in-flight candidates finish.
The pool is a named async actor so ``dice-ray verifiers scale N`` can resize it from outside the
job. Dispatch after NeMo-RL's environment pools and OpenRLHF's actor groups.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from dice_ray.config import RewardConfig, VerifyConfig
from dice_ray.tasks.task import Task
from dice_ray.verify.verdict import Verdict

POOL_NAME = "dice-ray-verifier-pool"
NAMESPACE = "dice-ray"
MAX_ATTEMPTS = 2


@ray.remote(max_restarts=-1, max_task_retries=0, num_cpus=0)
class VerifierActor:
    """One verifier on one GPU (or on CPU in compile-only mode); wraps :class:`~dice_ray.verify.verifier.Verifier`."""

    def __init__(self, verify_cfg: VerifyConfig, reward_cfg: RewardConfig):
        from dice_ray.verify.verifier import Verifier

        gpu_ids = ray.get_gpu_ids()
        if not gpu_ids:  # no GPU granted by Ray: never touch one that happens to be on the node
            verify_cfg = verify_cfg.model_copy(update={"mode": "compile_only"})
        self.verifier = Verifier(verify_cfg, reward_cfg, device=0 if gpu_ids else None)
        self.node = ray.util.get_node_ip_address()
        self.gpu = [str(g) for g in gpu_ids]
        self.done = 0

    def verify(self, task: Task, candidate_src: str, candidate_id: str) -> Verdict:
        verdict = self.verifier.verify(task, candidate_src, candidate_id)
        self.done += 1
        return verdict

    def info(self) -> dict:
        return {"node": self.node, "gpu": self.gpu, "mode": self.verifier.mode, "done": self.done}


@dataclass
class _Slot:
    """The pool's book-keeping for one verifier actor."""

    index: int
    handle: ray.actor.ActorHandle
    draining: bool = False
    busy: bool = False
    done: int = 0
    failures: int = 0
    busy_s: float = 0.0
    task: asyncio.Task | None = field(default=None, repr=False)


@dataclass
class _Item:
    candidate_id: str
    task: Task
    source: str
    future: asyncio.Future
    attempts: int = 0


@ray.remote(num_cpus=0, max_concurrency=1000)
class VerifierPool:
    """Named async actor dispatching candidates to verifier actors.

    Args:
        verify_cfg, reward_cfg: passed to every verifier actor.
        num_actors: initial pool size.
        gpus_per_actor: Ray GPUs a verifier actor asks for (0: CPU compile-only actors).
        call_timeout_s: an actor call longer than this (its own compile and run limits plus slack)
            is a ``timeout`` verdict, and the actor is restarted.
    """

    def __init__(
        self,
        verify_cfg: VerifyConfig,
        reward_cfg: RewardConfig,
        num_actors: int,
        gpus_per_actor: float,
        call_timeout_s: float,
    ):
        self.verify_cfg = verify_cfg
        self.reward_cfg = reward_cfg
        self.gpus_per_actor = gpus_per_actor
        self.call_timeout_s = call_timeout_s
        self.queue: asyncio.Queue[_Item] = asyncio.Queue()
        self.slots: list[_Slot] = []
        self.next_index = 0
        self.submitted = 0
        self.completed = 0
        self.started = time.monotonic()
        self._target = num_actors
        self._mode = "gpu" if gpus_per_actor > 0 else "compile_only"

    async def _ensure_started(self) -> None:
        if not self.slots and self._target:
            await self.scale(self._target)

    def _new_slot(self) -> _Slot:
        opts = {"num_gpus": self.gpus_per_actor} if self.gpus_per_actor > 0 else {}
        handle = VerifierActor.options(name=None, **opts).remote(self.verify_cfg, self.reward_cfg)
        slot = _Slot(index=self.next_index, handle=handle)
        self.next_index += 1
        slot.task = asyncio.get_running_loop().create_task(self._serve(slot))
        return slot

    async def _serve(self, slot: _Slot) -> None:
        while not slot.draining:
            try:
                item = await asyncio.wait_for(self.queue.get(), timeout=0.5)
            except asyncio.TimeoutError:
                continue
            if item.future.done():
                continue
            item.attempts += 1
            slot.busy = True
            t0 = time.monotonic()
            try:
                ref = slot.handle.verify.remote(item.task, item.source, item.candidate_id)
                verdict = await asyncio.wait_for(ref, timeout=self.call_timeout_s)
                self._resolve(item, verdict)
                slot.done += 1
            except (asyncio.TimeoutError, GetTimeoutError):
                slot.failures += 1
                ray.kill(slot.handle, no_restart=False)
                self._resolve(item, _pool_verdict(item, self._mode, "timeout", f"verifier actor gave no verdict within {self.call_timeout_s:.0f} s; actor restarted"))
            except RayActorError as exc:
                slot.failures += 1
                if item.attempts >= MAX_ATTEMPTS:
                    self._resolve(item, _pool_verdict(item, self._mode, "crash", f"verifier actor died {item.attempts} times on this candidate: {type(exc).__name__}"))
                else:
                    self.queue.put_nowait(item)
                await asyncio.sleep(1.0)
            finally:
                slot.busy = False
                slot.busy_s += time.monotonic() - t0

    def _resolve(self, item: _Item, verdict: Verdict) -> None:
        if not item.future.done():
            item.future.set_result(verdict)
            self.completed += 1

    async def verify_batch(self, items: list[tuple[str, Task, str]]) -> list[Verdict]:
        """Verify ``[(candidate_id, task, source), ...]``; returns one verdict each, in order.

        Raises:
            ValueError: a candidate id appears twice in the batch.
        """
        ids = [cid for cid, _, _ in items]
        if len(set(ids)) != len(ids):
            raise ValueError("verify_batch: candidate ids must be unique within a batch")
        await self._ensure_started()
        loop = asyncio.get_running_loop()
        pending = []
        for cid, task, src in items:
            item = _Item(candidate_id=cid, task=task, source=src, future=loop.create_future())
            self.queue.put_nowait(item)
            pending.append(item.future)
        self.submitted += len(items)
        return list(await asyncio.gather(*pending))

    async def scale(self, n: int) -> dict:
        """Grow or shrink to ``n`` actors; shrinking lets in-flight candidates finish first.

        Raises:
            ValueError: ``n`` < 1.
        """
        if n < 1:
            raise ValueError(f"verifier pool size must be >= 1, got {n}")
        self._target = n
        active = [s for s in self.slots if not s.draining]
        while len(active) < n:
            slot = self._new_slot()
            self.slots.append(slot)
            active.append(slot)
        for slot in active[n:]:
            slot.draining = True
            asyncio.get_running_loop().create_task(self._retire(slot))
        return await self.status()

    async def _retire(self, slot: _Slot) -> None:
        if slot.task is not None:
            await slot.task
        ray.kill(slot.handle, no_restart=True)
        self.slots.remove(slot)

    async def actors(self) -> list:
        """Handles of the serving verifier actors (for fault-injection tests and debugging)."""
        return [s.handle for s in self.slots if not s.draining]

    async def status(self) -> dict:
        """Pool size, queue depth, throughput and per-actor counters."""
        elapsed = max(time.monotonic() - self.started, 1e-9)
        return {
            "size": sum(1 for s in self.slots if not s.draining),
            "draining": sum(1 for s in self.slots if s.draining),
            "queue_depth": self.queue.qsize(),
            "in_flight": sum(1 for s in self.slots if s.busy),
            "submitted": self.submitted,
            "completed": self.completed,
            "throughput_per_s": self.completed / elapsed,
            "actors": [
                {"index": s.index, "done": s.done, "failures": s.failures, "busy_s": round(s.busy_s, 2), "draining": s.draining}
                for s in self.slots
            ],
        }


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
