"""The verifier: static rules, then a sandboxed worker that compiles, checks and times a candidate.

Pipeline for one candidate (every call returns exactly one :class:`Verdict`):

1. static anti-cheat rules on the source (:mod:`dice_ray.verify.rules`), in this process; a
   candidate in the load_inline format (KernelBench / DICE) is then built here by the compile pool
   (:meth:`Verifier._prepare_inline`, :mod:`dice_ray.verify.candidate.inline_build`: content-hash cache,
   parallel limited compilers) and the worker only imports the prebuilt extension;
2. in the persistent sandboxed worker (:mod:`dice_ray.verify.sandbox.runner`, one per Verifier):
   ``load`` (execute the candidate module: NVRTC compiles, limit ``compile_timeout_s``),
   ``reference`` (execute the reference, build it and run it on trial 0: it must run and be finite;
   the first job of a reference runs it twice (deterministic) and in float64, and the facts it
   measured come with every later job, :mod:`dice_ray.verify.trials.reference_facts`; jobs of a reference
   being measured wait for its facts, :mod:`dice_ray.verify.facts_book`; limit ``run_timeout_s``),
   ``run`` (``correctness_trials`` seeded trials, then CUDA-event timing of reference and candidate,
   limit ``run_timeout_s``);
   see :mod:`dice_ray.verify.trials.harness` for the run-time anti-cheat rules;
3. the reward (:func:`dice_ray.verify.reward.compute_reward`).

A crash, a timeout or a sticky CUDA error kills the worker; a new one is started at once and the
Verifier keeps serving (a worker left with a sticky CUDA error is stopped instead and killed in the
verifier's idle time, room permitting: :meth:`Verifier._suspend_for_idle`).  In compile-only mode (no
GPU) step 2 compiles, builds ``ModelNew`` on CPU, checks the kernels named in the source exist, and dry-runs ``forward`` on meta tensors.
"""

from __future__ import annotations

import hashlib
import math
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from dice_ray.config import RewardConfig, VerifyConfig
from dice_ray.tasks.sizing import input_dtypes
from dice_ray.verify.candidate.candidate import Candidate
from dice_ray.verify.facts_book import FactsBook
from dice_ray.verify.reward import compute_reward
from dice_ray.verify.rules.allowlist import import_allowed
from dice_ray.verify.rules.check import check_candidate
from dice_ray.verify.sandbox.environment import sweep_private_dirs
from dice_ray.verify.sandbox.runner import GpuGate, JobOutcome, WorkerError, WorkerProcess
from dice_ray.verify.sandbox.zygote import Zygote, ZygoteError
from dice_ray.verify.verdict import Verdict

__all__ = ["Verifier"]

_MAX_REASON = 8000
#: sandbox workers of a GPU verifier when ``VerifyConfig.workers`` is 0 (auto)
AUTO_GPU_WORKERS = 6
#: most spare workers a compile-only verifier keeps (``VerifyConfig.spare_workers`` counts on a GPU)
COMPILE_ONLY_SPARES = 2
#: GPU memory (MiB) budgeted for each spare worker, out of the verifier's share (``gpu_memory_fraction``): its
#: CUDA context and loaded kernels (~520 MiB on an H200) and, the other half, the room of a crashed worker waiting,
#: stopped, for the verifier's idle time to be killed (its allocator's memory: ~355 MiB on average for the
#: built-in suite's crashes on an H200; :meth:`Verifier._suspend_for_idle`)
SPARE_ROOM_MIB = 1024
#: ``spare_workers`` None (auto): this share of the verifier's GPU memory in spares' rooms, at most AUTO_MAX_SPARES
AUTO_SPARE_SHARE = 0.25
AUTO_MAX_SPARES = 32
#: least GPU memory (MiB) a worker's cap may come to once the spares' rooms are taken out
MIN_WORKER_MIB = 1024
#: most references whose facts (:mod:`dice_ray.verify.trials.reference_facts`) a Verifier keeps (~200 bytes each);
#: the oldest is dropped first
MAX_REFERENCE_FACTS = 100_000


def memory_plan(total_mib: float, fraction: float, workers: int, spare_workers: int | None) -> tuple[int, float]:
    """Split a GPU verifier's memory, ``fraction`` (``VerifyConfig.gpu_memory_fraction``) of the GPU's
    ``total_mib``, between its spares (:data:`SPARE_ROOM_MIB` each) and its ``workers``' caps.

    Args:
        spare_workers: ``VerifyConfig.spare_workers``; None (auto): :data:`AUTO_SPARE_SHARE` of that memory in
            spares' rooms, at most :data:`AUTO_MAX_SPARES` (31 on an H200: a step's crashes, e.g. the 28 of
            ``benchmarks/verifier_throughput.py``'s batch, each swap in a ready spare).

    Returns:
        ``(spares, cap)``: how many spares to keep, and each worker's cap as a share of ``total_mib`` (for
        ``torch.cuda.set_per_process_memory_fraction``).

    Raises:
        ValueError: an explicit ``spare_workers``' rooms leave a worker less than :data:`MIN_WORKER_MIB` (names
            the settings; auto keeps fewer spares instead, none on a GPU that small).
    """
    budget = fraction * total_mib
    if spare_workers is None:  # never below MIN_WORKER_MIB a worker on their account (a small GPU keeps none)
        fit = int((budget - workers * MIN_WORKER_MIB) / SPARE_ROOM_MIB)
        spares = max(0, min(AUTO_MAX_SPARES, int(AUTO_SPARE_SHARE * budget / SPARE_ROOM_MIB), fit))
    else:
        spares = spare_workers
    per_worker = (budget - spares * SPARE_ROOM_MIB) / workers
    if spares and per_worker < MIN_WORKER_MIB:
        raise ValueError(
            f"verify.spare_workers={spares} take {spares * SPARE_ROOM_MIB} MiB of the verifier's {budget:.0f} MiB "
            f"(verify.gpu_memory_fraction={fraction} of {total_mib:.0f} MiB), leaving each of its {workers} workers "
            f"{per_worker:.0f} MiB (at least {MIN_WORKER_MIB} needed): lower verify.spare_workers or verify.workers, "
            "or raise verify.gpu_memory_fraction")
    return spares, per_worker / total_mib


def _task_problem(task: Any) -> str | None:
    """Why ``task`` cannot be verified against (no str ``task_id`` / ``reference_src``, or a reference
    that breaks a rule of :func:`~dice_ray.tasks.task.validate_reference`: parsed, never run); None when it can."""
    from dice_ray.tasks.validate import TaskError, validate_reference

    for attr in ("task_id", "reference_src"):
        value = getattr(task, attr, None)
        if not isinstance(value, str):
            return f"the task has no str {attr} (task is a {type(task).__name__}, {attr}={value!r:.80})"
    try:
        validate_reference(task.reference_src, field=f"task {task.task_id}'s reference")
    except TaskError as e:
        return str(e)
    return None


def _reference_key(reference_src: str) -> str:
    """The key of a reference's facts (:class:`~dice_ray.verify.facts_book.FactsBook`): sha256 of its source."""
    return hashlib.sha256(reference_src.encode()).hexdigest()


class Verifier:
    """Verifies candidates of one task at a time in a sandboxed worker process.

    Args:
        verify_cfg: :class:`~dice_ray.config.VerifyConfig`.
        reward_cfg: :class:`~dice_ray.config.RewardConfig`.
        device: CUDA ordinal to run on; None: cuda:0 when ``mode`` is ``"gpu"``, or when it is
            ``"auto"`` and ``torch.cuda.is_available()``; otherwise compile-only.

    Attributes:
        mode: ``"gpu"`` or ``"compile_only"``.
        input_seed: base seed of every job's inputs (``VerifyConfig.input_seed``, else drawn at random here
            and never shown to a candidate).

    Raises:
        RuntimeError: ``verify_cfg.mode == "gpu"`` and no GPU is visible.
        ValueError: the spares' GPU memory would leave a worker under 1 GiB (:func:`memory_plan`).
        OSError: the worker process could not be spawned.
    """

    def __init__(self, verify_cfg: VerifyConfig, reward_cfg: RewardConfig, device: int | None = None):
        self.verify_cfg = verify_cfg
        self.reward_cfg = reward_cfg
        mode = verify_cfg.mode
        if mode == "compile_only":
            device = None
        else:
            import torch

            if torch.cuda.is_available():
                mode, device = "gpu", 0 if device is None else device
            elif mode == "gpu":
                raise RuntimeError("VerifyConfig.mode='gpu' but torch.cuda.is_available() is False")
            else:
                mode, device = "compile_only", None
        self.mode: str = mode
        self.device = device
        self.workers = verify_cfg.workers or (AUTO_GPU_WORKERS if mode == "gpu" else 1)
        # spares kept: crashing kernels are routine on a GPU (spares warm from the start, sized by its memory);
        # without one only a timeout or a hostile candidate needs a replacement (a few spares, started at the first)
        cap = verify_cfg.gpu_memory_fraction / self.workers
        if mode == "gpu":
            total_mib = torch.cuda.get_device_properties(device).total_memory / 2**20  # no CUDA context made
            self.spare_workers, cap = memory_plan(total_mib, verify_cfg.gpu_memory_fraction, self.workers,
                                                  verify_cfg.spare_workers)
        else:
            self.spare_workers = min(COMPILE_ONLY_SPARES if verify_cfg.spare_workers is None else verify_cfg.spare_workers,
                                     COMPILE_ONLY_SPARES)
        # the inputs' base seed: secret unless the config pins it; it goes with each job, not the workers' settings
        # (their command line), and one seed a Verifier keeps trial 0's inputs, hence its reference facts, the same
        self.input_seed = secrets.randbits(31) if verify_cfg.input_seed is None else verify_cfg.input_seed
        self._settings = {
            **verify_cfg.model_dump(exclude={"input_seed"}), "mode": mode, "device": device,
            "gpu_memory_fraction": cap,  # each worker's cap, a share of the GPU's memory (the workers share one GPU)
        }
        if mode == "gpu":  # a GPU worker imports load_inline candidates' .so files from the build cache (Landlock)
            from dice_ray.verify.candidate.inline_build import default_cache_dir

            cache = Path(verify_cfg.inline_cache_dir).expanduser() if verify_cfg.inline_cache_dir else default_cache_dir()
            try:
                cache.mkdir(parents=True, exist_ok=True)  # a rule needs the folder; the builder would make it later
            except OSError:
                pass  # the builder fails on it too: no load_inline candidate reaches a worker
            self._settings["sandbox_read_paths"] = [*verify_cfg.sandbox_read_paths, str(cache)]
        self._limits = {
            "load": verify_cfg.compile_timeout_s,
            "reference": verify_cfg.run_timeout_s,
            "run": verify_cfg.run_timeout_s,
            "timing": verify_cfg.run_timeout_s,
            "check": verify_cfg.run_timeout_s,
        }
        self.swept_dirs = sweep_private_dirs()  # folders left by verifiers that were killed
        self._gate = GpuGate() if mode == "gpu" else None
        self._lock = threading.Lock()  # guards _spares, _busy, restarts, closed
        self._idle: queue.Queue[WorkerProcess] = queue.Queue()
        self._busy: set[WorkerProcess] = set()
        self._spares: list[WorkerProcess] = []
        self._closed = False
        self._zygote: Zygote | None = None
        self._zygote_tried = False
        if mode == "gpu":  # its spares fork now; compile-only starts the fork server with its first spares
            self._start_zygote()
        for _ in range(self.workers):
            self._idle.put(WorkerProcess(self._settings, gate=self._gate))  # cold: the zygote is still importing torch
        if mode == "gpu":
            self._spares = [self._spare() for _ in range(self.spare_workers)]
        self.promoted = 0  # replacements that found no ready spare (one still starting, or a new worker)
        self.restarts = 0
        # reference (sha256 of its source) -> its facts, measured by one job at a time; only used while the
        # static rules run (without them a candidate can forge its worker's frames)
        self._facts = FactsBook(MAX_REFERENCE_FACTS)
        self._refills: list[threading.Thread] = []  # _refill threads (joined by close)
        self._suspended: list[WorkerProcess] = []  # crashed workers stopped, killed by _reap in idle time
        self._reaper: threading.Thread | None = None
        self.reaped_idle = 0  # crashed workers killed in idle time (the rest at once)
        self._forking = 0  # spares _refill threads are forking now
        self._retired: list[tuple[float | None, float, bool, float, float]] = []  # stats() rows of closed workers
        self._boot_phases: list[dict[str, float]] = []

    # -- worker lifecycle ----------------------------------------------------------------------
    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the current workers (one changes after a crash or timeout)."""
        with self._lock:
            return sorted([w.pid for w in list(self._idle.queue)] + [w.pid for w in self._busy])

    @property
    def worker_pid(self) -> int | None:
        """The worker's process id when there is one worker (tests and debugging)."""
        pids = self.worker_pids
        return pids[0] if pids else None

    def _start_zygote(self) -> None:
        """Start the fork server (:class:`~dice_ray.verify.sandbox.zygote.Zygote`) once, if ``fork_server`` is on and the
        Verifier is open; a platform without one leaves ``_zygote`` None (cold starts).  A compile-only Verifier
        calls it with its first spares: most never replace a worker, and the fork server is one more process
        importing torch (~4 CPU-s) beside the worker's own start-up."""
        with self._lock:
            if self._zygote_tried or self._closed or not self.verify_cfg.fork_server:
                return
            self._zygote_tried = True
            try:
                self._zygote = Zygote()
            except (ZygoteError, OSError):
                self._zygote = None

    def _spare(self) -> WorkerProcess:
        """A new spare worker: forked at once, its CUDA set-up in the verifier's idle time (``background``)."""
        return WorkerProcess(self._settings, self._zygote, self._gate, background=True)

    def _replacement(self, old: WorkerProcess) -> WorkerProcess:
        """Return a ready spare for ``old`` (else a starting one, promoted, else a new worker); a
        background thread (:meth:`_refill`) closes ``old`` and forks spares up to ``spare_workers``, so
        the job that lost its worker waits for neither (a crashed worker's exit, its CUDA context torn
        down, takes ~0.1 s; a fork from the zygote tens of ms).

        In compile-only mode spares (and the fork server they fork from) start at the first replacement,
        so a Verifier that never sees a crash runs ``workers`` processes (on a GPU they start with the Verifier); a crash costs a swap instead of a cold start
        (torch import and CUDA init, ~8 s on an H200 machine).  Replacements are forked from the
        :class:`~dice_ray.verify.sandbox.zygote.Zygote` (torch already imported) when ``fork_server`` is on.
        Starting a process does not block: a new worker boots while the others serve.

        A spare's CUDA set-up holds the GPU gate (a context made beside a timing stage moves its
        speedup), so it waits for the verifier to be idle (no verify call in progress for
        :data:`~dice_ray.verify.sandbox.runner.IDLE_GRACE_S`: between RL steps, while the policy samples); one
        needed before that is promoted and starts at once, holding up timing stages for its set-up's
        parts (~0.8-1.5 s in all on an H200).
        """
        with self._lock:
            self.restarts += 1
            self._retired.append((old.boot_s, old.ready_wait_s, old.forked, old.boot_gate_s, old.boot_gate_part_s))
            if old.info and old.forked:
                self._boot_phases.append(old.info.get("boot_phases_s", {}))
            alive = [w for w in self._spares if w.alive()]
            dead = [w for w in self._spares if not w.alive()]
            ready = [w for w in alive if w.ready]
            if ready:
                new = ready[0]
                alive.remove(new)
            else:
                self.promoted += 1
                new = alive.pop(0) if alive else WorkerProcess(self._settings, self._zygote, self._gate)
                new.promote()
            self._spares = alive
            forks = max(0, self.spare_workers - len(alive) - self._forking)
            self._forking += forks
            retired = [*dead] if self._suspend_for_idle(old) else [old, *dead]
            refill = threading.Thread(target=self._refill, args=(retired, forks), daemon=True,
                                      name="verifier-refill")
            self._refills = [t for t in self._refills if t.is_alive()] + [refill]
        refill.start()
        return new

    def _suspend_for_idle(self, old: WorkerProcess) -> bool:
        """Under the lock: keep a suspended (crashed) worker for :meth:`_reap` to kill in the verifier's
        idle time, if the spares' rooms allow (:data:`SPARE_ROOM_MIB`: at most one for each spare, holding at
        most half a room each on average); returns whether it was kept.  The promoted spare left its room's
        context part free, and its replacement starts in the idle time after the kill.  Not without the static
        rules: the memory figure comes in the worker's frame, which a candidate can forge then."""
        if (not old.suspended or old.reserved_mib is None or self._gate is None or self._closed
                or not self.verify_cfg.static_rules):
            return False
        if len(self._suspended) >= self.spare_workers or (
                self._suspended_mib() + old.reserved_mib > self.spare_workers * SPARE_ROOM_MIB / 2):
            return False
        self._suspended.append(old)
        if self._reaper is None:
            self._reaper = threading.Thread(target=self._reap, daemon=True, name="verifier-reaper")
            self._reaper.start()
        return True

    def _suspended_mib(self) -> float:
        """Under the lock: GPU memory (MiB) the suspended workers' allocators held at their faults."""
        return sum(w.reserved_mib or 0.0 for w in self._suspended)

    def _reap(self) -> None:
        """Kill the suspended workers in the verifier's idle time (:meth:`GpuGate.idle_turn`: spares' start-ups
        wait for it), until none is left."""
        assert self._gate is not None
        while True:
            with self._gate.idle_turn():
                with self._lock:
                    batch, self._suspended = self._suspended, []
                    if not batch:
                        self._reaper = None
                        return
                for w in batch:  # every SIGKILL first: their exits overlap
                    w.kill(wait=False)
                for w in batch:
                    w.close()
                with self._lock:
                    self.reaped_idle += len(batch)

    def _refill(self, retired: list[WorkerProcess], forks: int) -> None:
        """Close ``retired`` workers (reaping killed ones, removing their folders) and fork ``forks`` spares
        (starting the fork server first if it is not running yet: compile-only's first spares)."""
        for w in retired:
            w.close()
        fresh: list[WorkerProcess] = []
        try:
            if forks:
                self._start_zygote()
            for _ in range(forks):
                fresh.append(self._spare())
        finally:
            with self._lock:
                self._forking -= forks
                closed = self._closed
                if not closed:
                    self._spares.extend(fresh)
            if closed:
                for w in fresh:
                    w.close()

    def spares_ready(self) -> int:
        """How many spare workers are started and ready to replace a worker at once."""
        with self._lock:
            return sum(w.ready and w.alive() for w in self._spares)

    def wait_for_spares(self, timeout_s: float) -> float:
        """Block until every spare is forked and ready and every suspended (crashed) worker killed, or
        ``timeout_s`` (s) passed; returns the seconds waited.  Both happen only while no verify call is in
        progress, so call it between batches."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            with self._lock:
                spares, forking, suspended = list(self._spares), self._forking, len(self._suspended)
            if not forking and not suspended and all(w.ready or not w.alive() for w in spares):
                break
            time.sleep(0.02)
        return time.monotonic() - t0

    def stats(self) -> dict[str, Any]:
        """Worker book-keeping: ``workers``, ``restarts``, ``boot_s`` (spawn to ready of every worker
        so far, s; forked and cold separately), ``boot_gate_s_forked`` (of each forked worker's start,
        the seconds it held the GPU gate in all and in its longest part), ``ready_wait_s`` (job time spent waiting for a
        worker to become ready, s), ``spares`` / ``spares_ready`` (alive / started), ``promoted``
        (replacements that found no ready spare), ``spare_workers`` (the spares it keeps), ``suspended`` / ``suspended_mib`` /
        ``reaped_idle`` (crashed workers stopped and waiting for the verifier's idle time to be killed, the GPU
        memory their allocators held, MiB; those killed there so far), ``reference_facts`` / ``reference_facts_used`` (references
        whose facts are kept, :mod:`~dice_ray.verify.trials.reference_facts`; jobs that got them at their reference
        stage, :mod:`~dice_ray.verify.facts_book`) and, on a GPU, ``gpu_gate_s``: wall seconds the GPU gate was held
        exclusive (timing), draining (shared holders finishing while a timing stage waits), shared
        (references, trials, checks) or idle since the Verifier started
        (:meth:`~dice_ray.verify.sandbox.runner.GpuGate.held_seconds`), and ``confinement``: what the operating system
        enforces in a ready worker, ``{"landlock": ..., "seccomp": ...}`` (:mod:`~dice_ray.verify.sandbox.confine`; a
        layer the kernel or the machine lacks says ``not applied: why``; empty before a worker is ready)."""
        with self._lock:
            current = list(self._idle.queue) + list(self._busy)
            spares = [w for w in self._spares if w.alive()]
            suspended, suspended_mib = len(self._suspended), self._suspended_mib()
            rows = self._retired + [(w.boot_s, w.ready_wait_s, w.forked, w.boot_gate_s, w.boot_gate_part_s) for w in current]
        return {
            "workers": self.workers,
            "restarts": self.restarts,
            "boot_s_forked": [round(b, 2) for b, _, f, _, _ in rows if b is not None and f],
            "boot_s_cold": [round(b, 2) for b, _, f, _, _ in rows if b is not None and not f],
            "boot_gate_s_forked": [(round(g, 4), round(p, 4)) for b, _, f, g, p in rows if b is not None and f],
            "ready_wait_s": round(sum(w for _, w, _, _, _ in rows), 2),
            "spares": len(spares), "spares_ready": sum(w.ready for w in spares), "promoted": self.promoted,
            "spare_workers": self.spare_workers, "suspended": suspended, "suspended_mib": suspended_mib,
            "reaped_idle": self.reaped_idle,
            "forked_boot_phases_s": list(self._boot_phases),
            "reference_facts": len(self._facts), "reference_facts_used": self._facts.used,
            "gpu_gate_s": self._gate.held_seconds() if self._gate is not None else {},
            "confinement": next((w.info["confinement"] for w in current if w.info and "confinement" in w.info), {}),
        }

    def close(self) -> None:
        """Stop every worker and remove their temporary folders. The Verifier cannot verify afterwards."""
        with self._lock:
            self._closed = True
            workers = list(self._idle.queue) + list(self._busy) + self._spares + self._suspended
            self._spares, self._suspended = [], []
            refills = list(self._refills)
            reaper = self._reaper
        for t in refills:  # they close what they retired and the spares they fork
            t.join(timeout=60)
        if reaper is not None:  # it kills what it holds once no verify call is in progress
            reaper.join(timeout=60)
        for worker in workers:
            worker.close()
        if self._zygote is not None:
            self._zygote.close()
        builder = getattr(self, "_inline_builder", None)
        if builder is not None:
            builder.close()

    def __enter__(self) -> "Verifier":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- verification --------------------------------------------------------------------------
    def verify(self, task: Any, candidate_src: str, candidate_id: str) -> Verdict:
        """Verify one candidate against ``task.reference_src``; safe to call from several threads
        (each call takes one of the ``workers`` sandbox workers, waiting for a free one).

        Args:
            task: a :class:`dice_ray.tasks.task.Task` (only ``task_id`` and ``reference_src`` are read).
            candidate_src: the candidate module (fast format or ``load_inline``; README "Candidate format").
            candidate_id: echoed in the verdict.

        Returns:
            Exactly one :class:`Verdict`; never raises for a bad candidate or reference.  A task
            without a str ``task_id`` / ``reference_src``, or whose reference breaks a rule of
            :func:`~dice_ray.tasks.task.validate_reference` (checked by parsing, before the
            candidate), gets ``invalid_input`` with rule ``reference-invalid``.
        Raises:
            RuntimeError: the Verifier was closed.
        """
        t0 = time.monotonic()
        if self._closed:
            raise RuntimeError("Verifier is closed")
        try:
            with self._gate.job() if self._gate is not None else nullcontext():
                fields = self._verify(task, candidate_src)
        except Exception as e:  # noqa: BLE001 - an internal failure still yields one verdict
            fields = {"verdict": "crash", "reason": f"internal verifier error: {type(e).__name__}: {e}"}
        return self._verdict(task, candidate_id, fields, time.monotonic() - t0)

    def verify_many(self, items: list[tuple[Any, str, str]]) -> list[Verdict]:
        """Verify ``[(task, candidate_src, candidate_id), ...]`` over the workers; verdicts in order.

        Raises:
            RuntimeError: the Verifier was closed.
            ValueError: an item is not a ``(task, candidate_src, candidate_id)`` triple (checked
                before any is verified, naming its index).
        """
        if not items:
            return []
        for i, it in enumerate(items):
            if not isinstance(it, (tuple, list)) or len(it) != 3:
                raise ValueError(f"verify_many: items[{i}] must be (task, candidate_src, candidate_id), "
                                 f"got {type(it).__name__}" + (f" of {len(it)}" if isinstance(it, (tuple, list)) else ""))
        with ThreadPoolExecutor(max_workers=min(self.workers, len(items)), thread_name_prefix="verify") as ex:
            return list(ex.map(lambda it: self.verify(*it), items))

    def _verify(self, task: Any, candidate_src: str) -> dict[str, Any]:
        bad_task = _task_problem(task)
        if bad_task is not None:
            return {"verdict": "invalid_input", "rule": "reference-invalid", "reason": bad_task}
        if isinstance(candidate_src, (bytes, bytearray)):
            try:
                candidate_src.decode("utf-8")
                why = f"candidate is {type(candidate_src).__name__}, not source text (decode it first)"
            except UnicodeDecodeError as e:
                why = f"candidate is not UTF-8 text ({e.reason} at byte {e.start})"
            return {"verdict": "compile_error", "reason": why}
        if not isinstance(candidate_src, str):
            return {"verdict": "compile_error", "reason": f"candidate is a {type(candidate_src).__name__}, not source text"}
        t0 = time.monotonic()
        # the candidate is read once here: every stage below reads this object, the worker gets its runnable text
        candidate = Candidate.from_source(candidate_src, allow_vendor_libraries=self.verify_cfg.allow_vendor_libraries)
        report = check_candidate(candidate, input_dtypes=input_dtypes(task.reference_src)) \
            if self.verify_cfg.static_rules else None
        stages = {"static": round(time.monotonic() - t0, 4)}
        runnable = candidate.source
        if report is not None:
            first = report.first()
            if first is not None:
                others = list(dict.fromkeys(str(v) for v in report.violations if v is not first))[:5]
                reason = str(first) + (f"\nalso: {'; '.join(others)}" if others else "")
                return {"verdict": first.verdict, "reason": reason, "rule": first.rule, "stage_seconds": stages}
            # dead imports (used by nothing that runs: a copy of get_inputs) do not run: the worker's guard refuses them
            fmt = candidate.format == "inline"
            runnable = candidate.runnable_source(lambda m, n: import_allowed(m, n, inline=fmt))
        t0 = time.monotonic()
        inline = self._prepare_inline(candidate)  # None: fast format; verdict fields, or the prebuilt modules
        if inline is not None:
            stages["compile"] = round(time.monotonic() - t0, 4)  # the load_inline build (cached: milliseconds)
            if "verdict" in inline:
                return {**inline, "stage_seconds": stages}
        job = {
            "task_id": task.task_id,
            "input_seed": self.input_seed,
            "reference_src": task.reference_src,
            "candidate_src": runnable,
            "kernel_refs": {k: sorted(v) for k, v in (report.kernel_refs if report else {}).items()},
            "cpu_budget_s": self.verify_cfg.compile_timeout_s + 4 * self.verify_cfg.run_timeout_s + 30,
        }
        if inline is not None:
            job["inline"] = inline
        fields = self._from_outcome(self._run_job(job))
        return {**fields, "stage_seconds": {**stages, **fields["stage_seconds"]}}

    def _run_job(self, job: dict[str, Any]) -> JobOutcome:
        """Run ``job`` on an idle worker (waiting for one), swapping a dead or worn-out worker first and
        after; the worker goes back to the idle queue (closed instead once the Verifier is).  A worker that
        fails before it takes the job gives a ``died`` outcome (and its replacement is made)."""
        worker = self._idle.get()
        with self._lock:
            self._busy.add(worker)
        try:
            if not worker.alive() or worker.jobs >= self.verify_cfg.max_jobs_per_worker:
                worker = self._swap(worker)
            ref_key, token = _reference_key(job["reference_src"]), object()
            try:
                while True:
                    try:
                        outcome = worker.run(job, self._limits, self._facts_exchange(ref_key, token))
                        break
                    except WorkerError as e:
                        # a start that failed under Landlock turned it off for the workers started after it
                        # (confine.give_up_landlock): the job goes to one of those, not into the candidate's verdict
                        again = worker.landlock and not self._settings.get("landlock", True)
                        worker = self._swap(worker)
                        if not again:
                            return JobOutcome("died", "load", detail=f"sandbox worker failed: {e}")
            finally:
                self._facts.done(ref_key, token)
            if not worker.alive():
                worker = self._swap(worker)
            return outcome
        finally:
            with self._lock:
                self._busy.discard(worker)
                closed = self._closed
            if closed:
                worker.close()
            else:
                self._idle.put(worker)

    def prepare(self, tasks: Iterable[Any]) -> dict[str, Any]:
        """Measure the reference facts of ``tasks`` before their candidates come (:mod:`~dice_ray.verify.trials.reference_facts`:
        the determinism check's second reference run and the float64 run, which a task's first job would
        otherwise do while its group waits, :mod:`~dice_ray.verify.facts_book`).  Each reference not known
        yet runs as a job of its own over the workers, under the GPU gate like any job (so it never runs
        beside a timing stage); call it while the verifier is otherwise idle: the trainer does at start,
        while the learner warm-starts (:meth:`VerifierPool.prepare <dice_ray.cluster.verifier_pool.VerifierPool.prepare>`).
        Blocks until done; safe beside :meth:`verify` calls.

        Args:
            tasks: :class:`~dice_ray.tasks.task.Task` objects (``task_id``, ``reference_src``); duplicates
                of one reference are measured once.

        Returns:
            ``{"measured": n, "known": n, "failed": {task_id: reason}, "seconds": s}``: references measured
            now, known before, and those whose reference broke a rule (their candidates' verdicts will say
            ``invalid_input`` with it) or whose task is malformed.  Nothing is measured in compile-only mode
            or without the static rules (then the facts are never used): ``"skipped"`` says why.
        Raises:
            RuntimeError: the Verifier was closed.
        """
        t0 = time.monotonic()
        if self._closed:
            raise RuntimeError("Verifier is closed")
        out: dict[str, Any] = {"measured": 0, "known": 0, "failed": {}, "seconds": 0.0}
        if self.mode != "gpu" or not self.verify_cfg.static_rules:
            return {**out, "skipped": "compile-only: no reference runs" if self.mode != "gpu" else
                    "static rules off: reference facts are not used"}
        todo: dict[str, Any] = {}
        known: set[str] = set()
        for task in tasks:
            problem = _task_problem(task)
            if problem is not None:
                out["failed"][str(getattr(task, "task_id", "?"))] = problem
                continue
            key = _reference_key(task.reference_src)
            if key in self._facts:
                known.add(key)
            else:
                todo.setdefault(key, task)
        out["known"] = len(known)

        def measure(task: Any) -> tuple[Any, dict[str, Any]]:
            job = {"task_id": task.task_id, "reference_src": task.reference_src, "reference_only": True,
                   "input_seed": self.input_seed, "cpu_budget_s": 2 * self.verify_cfg.run_timeout_s + 30}
            try:
                with self._gate.job():
                    return task, self._from_outcome(self._run_job(job))
            except Exception as e:  # noqa: BLE001 - an internal failure is that task's entry, as in verify()
                return task, {"verdict": "crash", "reason": f"internal verifier error: {type(e).__name__}: {e}"}

        if todo:
            with ThreadPoolExecutor(max_workers=min(self.workers, len(todo)), thread_name_prefix="prepare") as ex:
                for task, fields in ex.map(measure, todo.values()):
                    if fields.get("verdict") == "ok":
                        out["measured"] += 1
                    else:
                        rule = f" [{fields['rule']}]" if fields.get("rule") else ""
                        out["failed"][task.task_id] = f"{fields.get('verdict')}{rule}: {str(fields.get('reason', ''))[:300]}"
        out["seconds"] = round(time.monotonic() - t0, 3)
        return out

    def _facts_exchange(self, ref_key: str, token: object) -> Callable[[dict[str, Any]], dict[str, Any] | None] | None:
        """The job's ``on_stage`` hook (:meth:`WorkerProcess.run`) for the reference facts of ``ref_key``:
        facts the worker announces with a stage are kept; at the ``reference`` stage the known facts go
        with the go, or this job measures them, or it waits for the job measuring them
        (:meth:`FactsBook.claim`, at most ``run_timeout_s``).  None without the static rules, and in
        compile-only mode (no reference runs there: its jobs would wait for each other for nothing)."""
        if not self.verify_cfg.static_rules or self.mode != "gpu":
            return None

        def on_stage(msg: dict[str, Any]) -> dict[str, Any] | None:
            learnt = msg.get("reference_facts")
            if isinstance(learnt, dict):
                self._facts.keep(ref_key, learnt)
            if msg.get("stage") != "reference":
                return None
            facts = self._facts.claim(ref_key, token, self.verify_cfg.run_timeout_s)
            return None if facts is None else {"reference_facts": facts}

        return on_stage

    def _prepare_inline(self, candidate: Candidate | str) -> dict[str, Any] | None:
        """Build a load_inline candidate's extensions before it goes to a worker.

        ``candidate``: the :class:`~dice_ray.verify.candidate.candidate.Candidate` read at :meth:`verify`'s entry
        (its format and ``load_inline`` calls are read there, not again here), or a source text, read here.

        The builder (:class:`~dice_ray.verify.candidate.inline_build.InlineBuilder`, ``inline_*`` fields of
        :class:`~dice_ray.config.VerifyConfig`) is created at the first such candidate (thread-safe)
        and shared by this Verifier's threads: identical specs compile once, different ones in
        parallel; on a GPU the ``.so`` is linked for this device's arch (with the vendor libraries
        the sources use when ``allow_vendor_libraries``), in compile-only mode only the objects are
        built.

        Returns:
            None for a fast-format candidate; verdict fields (``compile_error``: a dynamic
            ``load_inline`` argument, rule ``unsupported-format``, or the nvcc / g++ log) when it
            cannot be built; else ``{"modules": [...]}`` for the worker's
            :func:`dice_ray.verify.trials.execution.exec_inline`, with ``"allow_vendor_libraries"`` so the
            worker reads the run-time ``load_inline`` call by the same rules.
        """
        candidate = Candidate.coerce(candidate, allow_vendor_libraries=self.verify_cfg.allow_vendor_libraries)
        if candidate.format != "inline":
            return None
        e = candidate.spec_error
        if e is not None:
            rule = getattr(e, "rule", "unsupported-format")
            return {"verdict": "cheat" if rule == "cuda-library" else "compile_error", "rule": rule,
                    "reason": f"[{rule}] {e}"}
        specs = candidate.specs
        if not specs:
            return {"verdict": "compile_error", "rule": "unsupported-format",
                    "reason": "[unsupported-format] no top-level `name = load_inline(...)` call"}
        from dice_ray.verify.candidate.inline_build import InlineBuilder, device_arch

        cfg = self.verify_cfg

        def make() -> InlineBuilder:
            return InlineBuilder(
                cfg.inline_cache_dir, arch=device_arch(self.device) if self.mode == "gpu" else cfg.arch,
                link=self.mode == "gpu", max_builds=cfg.inline_max_builds, timeout_s=cfg.inline_build_timeout_s,
                cpu_s=cfg.inline_build_cpu_s, memory_gib=cfg.inline_build_memory_gib,
                file_mib=cfg.inline_build_file_mib, lite_headers=cfg.inline_lite_headers, pch=cfg.inline_pch,
                host_opt=cfg.inline_host_opt, link_vendor_libraries=cfg.allow_vendor_libraries)

        builder = InlineBuilder.create_once(self, "_inline_builder", make)
        results = [f.result() for f in [builder.submit(spec) for spec in specs]]
        for r in results:
            if not r.ok:
                return {"verdict": "compile_error", "reason": r.reason()}
        return {"modules": [r.job_entry(spec) for r, spec in zip(results, specs)],
                "allow_vendor_libraries": cfg.allow_vendor_libraries}

    def _swap(self, worker: WorkerProcess) -> WorkerProcess:
        with self._lock:
            self._busy.discard(worker)
        new = self._replacement(worker)
        with self._lock:
            self._busy.add(new)
        return new

    def _from_outcome(self, outcome: JobOutcome) -> dict[str, Any]:
        fields = self._outcome_fields(outcome)
        parts = fields.pop("parts_s", None) or {}  # "stage.part" keys (JobResult.parts_s)
        return {**fields, "stage_seconds": {**outcome.stage_s, **parts}}

    @staticmethod
    def _outcome_fields(outcome: JobOutcome) -> dict[str, Any]:
        if outcome.kind == "result":
            r = dict(outcome.result or {})
            kind = r.get("verdict", "crash")
            if kind == "compile_error" and r.get("rule"):
                r["reason"] = f"[{r['rule']}] {r.get('reason', '')}"
            if kind not in ("cheat", "invalid_input", "compile_error"):
                r["rule"] = None
            return r
        stage = outcome.stage
        if outcome.kind == "timeout":
            if stage == "reference":
                return {"verdict": "invalid_input", "rule": "reference-timeout", "compiled": True,
                        "reason": f"the reference did not finish: {outcome.detail}"}
            what = "loading the candidate module (NVRTC compile)" if stage == "load" else "running the candidate"
            return {"verdict": "timeout", "compiled": stage != "load", "reason": f"{what}: {outcome.detail}"}
        if stage == "reference":
            return {"verdict": "invalid_input", "rule": "reference-crash", "compiled": True,
                    "reason": f"the worker died in the reference stage: {outcome.detail}"}
        return {"verdict": "crash", "compiled": stage != "load",
                "reason": f"the worker died in stage {stage!r}: {outcome.detail}"}

    def _verdict(self, task: Any, candidate_id: str, f: dict[str, Any], seconds: float) -> Verdict:
        """The Verdict of one verification from its fields ``f``: a worker's JobResult (:meth:`_from_outcome`) or
        the fields of what ended before or outside the worker.  A Verdict field ``f`` holds is taken as it is
        (``rule``, ``ref_ms``, ``candidate_ms``, the spreads), one it lacks is None; only what the verdict decides
        is named here: which verifier, task and candidate, the reward, ``correct`` only for ``ok`` / ``incorrect``,
        the speedups and ``compiled_ref_ms`` only for ``ok`` (a speedup that is not finite and positive: None), the
        reason cut to ``_MAX_REASON`` characters, ``seconds`` (wall time of the verification, s)."""
        kind = f.get("verdict", "crash")
        compiled = bool(f.get("compiled", False))
        correct = f.get("correct")
        speedup = f.get("speedup")
        if speedup is not None and not (math.isfinite(speedup) and speedup > 0):
            speedup = None
        reward = (
            compute_reward(compiled, correct, False, speedup, self.reward_cfg) if kind == "ok" else 0.0
        )
        reason = str(f.get("reason", ""))
        if len(reason) > _MAX_REASON:
            reason = reason[: _MAX_REASON - 20] + "\n...[truncated]"
        fields = {name: f.get(name) for name in Verdict.model_fields}
        fields.update(
            candidate_id=str(candidate_id),
            task_id=str(getattr(task, "task_id", "?")),
            verdict=kind,
            compiled=compiled,
            correct=correct if kind in ("ok", "incorrect") else None,
            speedup=speedup if kind == "ok" else None,
            reward=reward,
            reason=reason,
            compiled_ref_ms=f.get("compiled_ref_ms") if kind == "ok" else None,
            speedup_compiled=f.get("speedup_compiled") if kind == "ok" else None,
            mode=self.mode,
            seconds=seconds,
            stage_seconds=f.get("stage_seconds") or {},
        )
        return Verdict(**fields)
