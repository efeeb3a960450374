"""Parent side of the sandbox: one persistent worker process, jobs with per-stage hard timeouts.

The worker (:mod:`dice_ray.verify.sandbox.worker`) is a ``subprocess`` of ``sys.executable`` in its own
session, with a private temporary folder as cwd, a stripped environment, stdout/stderr to a log
file, and two pipes for :mod:`dice_ray.verify.sandbox.protocol` frames.  A job that overruns its stage's
limit, or a worker that dies (signal, ``os._exit``, sticky CUDA error), ends with the process
group killed; the caller starts a new worker.  KernelBench runs candidates in the evaluating
process, where one bad kernel poisons every later one: that is the gap this closes.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dice_ray.verify.sandbox.confine import give_up_landlock, log_status_once
from dice_ray.verify.sandbox.environment import clean_env, private_dir
from dice_ray.verify.sandbox.protocol import FrameReader, ProtocolError, write_frame
from dice_ray.verify.sandbox.zygote import Zygote, ZygoteError

__all__ = ["STAGE_ACCESS", "GpuGate", "JobOutcome", "WorkerError", "WorkerProcess"]


#: GPU access each stage needs: loading compiles on the CPU, checks share the GPU, timing owns it; a
#: starting worker's CUDA set-up (``setup``: context, kernel preload) shares it, so no timing stage runs
#: beside it, and its last stage (``limits``: collecting, sandbox limits) needs none
STAGE_ACCESS: dict[str, str | None] = {"setup": "shared", "load": None, "reference": "shared", "run": "shared",
                                       "timing": "exclusive", "check": "shared", "limits": None}


#: seconds the verifier must have had no verify call in progress before a spare's start-up takes the gate
IDLE_GRACE_S = 0.5

#: spares' start-ups in the verifier's idle time under way at once (:meth:`GpuGate.startup_slot`): 28
#: at once made each CUDA context take seconds (the driver makes them one at a time), so a verify call
#: that came meanwhile waited up to ~6 s for one start-up part before its first timing stage
STARTUP_SLOTS = 4


class GpuGate:
    """Shared/exclusive access of one verifier's workers to their GPU (a writer-preferring RW lock).

    Several workers load, compile and check candidates at once (``shared``), but a worker times
    alone (``exclusive``): no other worker's kernels run while its CUDA events are open, so the
    speedup does not depend on how busy the verifier is.

    A worker's start-up (``startup`` acquisitions: a CUDA context, a kernel preload, parts of up to
    ~0.5 s) holds shared access too, and a timing stage waits for its part to end; meanwhile jobs'
    shared stages may still start (they end in milliseconds), so the GPU does the batch's other work
    instead of standing by.  Other shared holders may not start while a timing stage waits.

    Spares start in the verifier's idle time, at most ``startup_slots`` at once
    (:meth:`startup_slot`), so each part stays short and a verify call that comes meanwhile soon has
    the GPU.

    :meth:`held_seconds` tells how the wall time went: exclusive, draining (shared holders finishing
    their parts while a timing stage waits), shared (>= 1 holder) or idle.

    Args:
        startup_slots: background start-ups under way at once (:data:`STARTUP_SLOTS`).
    """

    def __init__(self, startup_slots: int = STARTUP_SLOTS) -> None:
        self._cond = threading.Condition()
        self.startup_slots = startup_slots
        self._starting = 0  # background start-ups holding a slot (startup_slot)
        self._readers = 0
        self._startup_readers = 0  # of them, workers' start-ups (a timing stage waiting does not stop jobs then)
        self._writer = False
        self._writers_waiting = 0
        self._jobs = 0  # verify calls in progress (:meth:`job`): background acquisitions wait for none
        self._idle_since = time.monotonic()  # when the last of them ended
        self._since = time.monotonic()  # start of the current state's interval
        self._held = {"exclusive": 0.0, "draining": 0.0, "shared": 0.0, "idle": 0.0}

    def _state(self) -> str:
        if self._writer:
            return "exclusive"
        if self._readers:
            return "draining" if self._writers_waiting else "shared"
        return "idle"

    def _account(self) -> None:
        """Add the time since the last change to the current state (call under the lock, before a change)."""
        now = time.monotonic()
        self._held[self._state()] += now - self._since
        self._since = now

    def held_seconds(self) -> dict[str, float]:
        """Wall seconds since the gate was made with exclusive access held, with shared access held
        while a worker waits for exclusive access (``draining``), with shared access held (by >= 1
        worker) and none waiting, and with neither (``idle``); they add up to the gate's age."""
        with self._cond:
            self._account()
            return dict(self._held)

    @contextmanager
    def job(self) -> Iterator[None]:
        """A verify call in progress: while any is, background acquisitions (:meth:`acquire`) wait."""
        with self._cond:
            self._jobs += 1
        try:
            yield
        finally:
            self._job_ended()

    @contextmanager
    def idle_turn(self) -> Iterator[None]:
        """Wait for the verifier's idle time (no verify call in progress for :data:`IDLE_GRACE_S`), then
        count as a verify call while inside, so background acquisitions (spares' start-ups) wait for it
        (the Verifier reaps suspended workers this way: their exits stall other processes' allocations)."""
        with self._cond:
            self._wait_background(lambda: True)
            self._jobs += 1
        try:
            yield
        finally:
            self._job_ended()

    @contextmanager
    def startup_slot(self, background: Callable[[], bool]) -> Iterator[None]:
        """A worker's start-up: while ``background()`` is True (a spare, not promoted), first wait until
        fewer than ``startup_slots`` such start-ups are under way, and hold a slot until the start-up
        ends; a promoted one (``background()`` False, then :meth:`wake`) goes at once without a slot."""
        with self._cond:
            self._cond.wait_for(lambda: not background() or self._starting < self.startup_slots)
            counted = background()
            self._starting += counted
        try:
            yield
        finally:
            if counted:
                with self._cond:
                    self._starting -= 1
                    self._cond.notify_all()

    def _job_ended(self) -> None:
        with self._cond:
            self._jobs -= 1
            if not self._jobs:
                self._idle_since = time.monotonic()
                self._cond.notify_all()

    def wake(self) -> None:
        """Make waiting acquisitions look at their conditions again (a background one was promoted)."""
        with self._cond:
            self._cond.notify_all()

    def acquire(self, mode: str, background: Callable[[], bool] | None = None, startup: bool = False) -> None:
        """Block until ``mode`` (``"shared"`` or ``"exclusive"``) access is granted.

        Args:
            background: while it returns True, first wait until no verify call has been in progress
                (:meth:`job`) for :data:`IDLE_GRACE_S`: a spare worker's start-up runs in the verifier's
                idle time (between RL steps), not between the calls of a loop or beside a batch, unless it
                is promoted (the callable turns False; call :meth:`wake`).
            startup: a worker's start-up part (no effect on exclusive access): it waits for waiting timing
                stages like a job's part, but while one holds, jobs' shared parts start despite a waiting timing stage.
        """
        with self._cond:
            if mode == "exclusive":
                self._wait_background(background)
                self._account()  # shared holders now drain
                self._writers_waiting += 1
                self._cond.wait_for(lambda: not self._writer and self._readers == 0)
                self._writers_waiting -= 1
                self._account()
                self._writer = True
            else:
                self._wait_background(background, lambda: not self._writer and (
                    self._writers_waiting == 0 or (self._startup_readers > 0 and not startup)))
                self._account()
                self._readers += 1
                self._startup_readers += startup

    def _wait_background(self, background: Callable[[], bool] | None, also: Callable[[], bool] = lambda: True) -> None:
        """Under the lock: wait until a ``background`` acquisition may go (:meth:`acquire`) and ``also()``."""
        while True:
            wait = 0.0
            if background is not None and background():
                wait = math.inf if self._jobs else self._idle_since + IDLE_GRACE_S - time.monotonic()
            if wait <= 0 and also():
                return
            self._cond.wait(wait if 0 < wait < math.inf else None)  # woken by a job, a release or a promotion

    def yield_shared(self, background: Callable[[], bool] | None = None, startup: bool = False) -> None:
        """Holding shared access: let the workers waiting for exclusive access go first (give it
        back and take it again; returns at once when none waits).  A worker calls this between
        the parts of a long shared stage, so a timing stage does not wait for all of it.  A
        ``background`` holder (:meth:`acquire`) also steps aside while a verify call is in progress."""
        with self._cond:
            if not self._writers_waiting and not (background is not None and self._jobs and background()):
                return
        self.release("shared", startup)
        self.acquire("shared", background, startup)

    def release(self, mode: str, startup: bool = False) -> None:
        """Give back access taken with :meth:`acquire` in the same ``mode`` and ``startup`` (ignored for exclusive)."""
        with self._cond:
            self._account()
            if mode == "exclusive":
                self._writer = False
            else:
                self._readers -= 1
                self._startup_readers -= startup
            self._cond.notify_all()


class WorkerError(RuntimeError):
    """The worker could not start (its log tail is in the message)."""


@dataclass
class JobOutcome:
    """How a job ended: ``kind`` is ``"result"`` (``result`` holds the worker's JobResult dict),
    ``"timeout"`` or ``"died"``; ``stage`` is the last stage the worker announced; ``detail``
    says how it died or which limit it passed, with the worker log's tail; ``stage_s`` the wall
    seconds of each stage, and of waiting for the GPU gate (``gate_wait``)."""

    kind: str
    stage: str
    result: dict[str, Any] | None = None
    detail: str = ""
    stage_s: dict[str, float] = field(default_factory=dict)


class _Forked:
    """A worker forked by the :class:`~dice_ray.verify.sandbox.zygote.Zygote`: the ``Popen`` calls the runner
    uses (``pid``, ``poll``, ``wait``, ``kill``), through ``waitpid`` on a re-parented child."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: gone, how is unknown
                self.returncode = -signal.SIGKILL
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
            time.sleep(0.005)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class WorkerProcess:
    """One sandboxed worker.

    Args:
        settings: passed to the worker (mode, device, arch, limits, tolerances...).
        zygote: fork the worker from this fork server (about a second) instead of starting a new
            interpreter (about 8 s with torch); None, or a zygote that fails, gives a cold start.
        gate: the GPU gate of the verifier's workers: the start-up self-test's stages take it like
            a job's (its timing runs alone), so a worker starting never disturbs another's timing.
        background: a spare: its start-up takes the gate only while no verify call is in progress
            (:meth:`GpuGate.acquire`), so it runs in the verifier's idle time, until :meth:`promote`;
            the start-up limit (``start_timeout_s``) does not count the wait.
    Raises:
        OSError: the process could not be spawned.
    """

    def __init__(self, settings: dict[str, Any], zygote: Zygote | None = None, gate: GpuGate | None = None,
                 background: bool = False):
        self.settings = settings
        self.landlock = bool(settings.get("landlock", True))  # it starts under Landlock (dice_ray.verify.sandbox.confine)
        self.gate = gate
        self.background = background
        self.workdir = private_dir("worker")
        self.log_path = Path(self.workdir) / "worker.log"
        req_r, req_w = os.pipe()
        res_r, res_w = os.pipe()
        self.proc: subprocess.Popen | _Forked | None = None
        if zygote is not None:
            try:
                self.proc = _Forked(zygote.spawn(self.workdir, settings, (req_r, res_w)))
            except ZygoteError:
                self.proc = None
        self.forked = self.proc is not None  # forked by the zygote (else a cold start)
        if self.proc is None:
            with open(self.log_path, "wb") as log:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "dice_ray.verify.sandbox.worker", str(req_r), str(res_w), json.dumps(settings)],
                    pass_fds=(req_r, res_w),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=self.workdir,
                    env=clean_env(self.workdir),
                    start_new_session=True,
                )
        os.close(req_r)
        os.close(res_w)
        self._w = req_w
        self._reader = FrameReader(res_r)
        self.info: dict[str, Any] | None = None
        self.jobs = 0
        self.started = time.monotonic()
        self.boot_s: float | None = None  # spawn to ready (s)
        self.boot_gate_s = 0.0  # seconds its self-test held the GPU gate (the sum of its parts)
        self.boot_gate_part_s = 0.0  # the longest of those parts: what a timing stage may wait for it
        self.ready_wait_s = 0.0  # time jobs waited for it to become ready (s)
        self._boot_error: str | None = None
        self._killed = False  # SIGKILL sent (its exit may still be under way: kill(wait=False))
        self.suspended = False  # SIGSTOP sent after a sticky CUDA error (suspend()): kill() or close() ends it
        self.reserved_mib: float | None = None  # GPU memory its allocator held when it was suspended (MiB)
        self._closing = threading.Lock()
        self._closed = False  # close() ran: its pipe descriptors are closed
        self._booting = threading.Thread(target=self._boot, daemon=True, name=f"boot-{self.pid}")
        self._booting.start()

    @property
    def pid(self) -> int:
        """The worker's process id."""
        return self.proc.pid

    def alive(self) -> bool:
        """The process runs and was neither killed (a killed one may take ~0.1 s more to exit) nor suspended."""
        return not self._killed and not self.suspended and self.proc.poll() is None

    @property
    def ready(self) -> bool:
        """It said ``ready``: a job sent now starts at once."""
        return self.info is not None

    def promote(self) -> None:
        """A background start-up is needed now: from its next gate acquisition on it waits like a
        job's stage, not for the verifier to be idle."""
        if self.background:
            self.background = False
            if self.gate is not None:
                self.gate.wake()

    def log_tail(self, chars: int = 1500) -> str:
        """The last ``chars`` characters of the worker's log (its stdout and stderr), "" when unreadable."""
        try:
            data = self.log_path.read_bytes()[-chars:]
        except OSError:
            return ""
        return data.decode(errors="replace").strip()

    def _death(self) -> str:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "worker stopped answering"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = str(-code)
            how = f"worker killed by signal {name}"
        else:
            how = f"worker exited with code {code}"
        tail = self.log_tail()
        return f"{how}; log tail:\n{tail}" if tail else how

    def _boot(self) -> None:
        """Wait for ``ready`` in a thread (so :attr:`boot_s` is the real start time, spawn to
        ready); a failure or a start past ``start_timeout_s`` is kept for :meth:`wait_ready`.

        Imports are not gated; the CUDA set-up (``setup``: context, kernel preload, in parts) and the
        self-test announce their stages like a job, and each takes the gate access of :data:`STAGE_ACCESS`
        (no timing stage runs beside a context being made; the self-test's timing stage runs alone; a
        stage announced again is its next part: a waiting timing stage goes first, as in :meth:`run`).
        :attr:`boot_gate_s` and :attr:`boot_gate_part_s` say how long it held the gate.
        """
        deadline = time.monotonic() + self.settings.get("start_timeout_s", 180.0)
        held: str | None = None
        stage = ""
        mark = time.monotonic()  # start of the current part
        slot = ExitStack()
        try:
            while True:
                try:
                    msg = self._reader.read(max(0.0, deadline - time.monotonic()))
                except ProtocolError:
                    self._boot_failed(stage, f"verifier worker died while starting: {self._death()}")
                    return
                if held is not None:
                    part = time.monotonic() - mark
                    self.boot_gate_s += part
                    self.boot_gate_part_s = max(self.boot_gate_part_s, part)
                if msg is not None and msg.get("type") == "stage":
                    asked = time.monotonic()
                    if stage == "" and self.gate is not None:  # its first gate access: a spare waits for a slot
                        slot.enter_context(self.gate.startup_slot(lambda: self.background))
                    stage, held = self._enter(str(msg.get("stage")), stage, held, lambda: self.background, startup=True)
                    mark = time.monotonic()
                    deadline += mark - asked  # waiting for the gate (a spare: for the verifier's idle time) does not count
                    try:
                        write_frame(self._w, {"op": "go"})
                    except OSError:
                        pass  # it died: the next read says how
                    continue
                break
        finally:
            self._switch_gate(held, None, startup=True)
            slot.close()
        if msg is None:
            self._boot_failed(stage, f"verifier worker not ready in time; log tail:\n{self.log_tail()}")
        elif msg.get("type") != "ready":
            self._boot_failed(stage, f"verifier worker failed to start:\n{msg.get('error', msg)}")
        else:
            self.info = msg["info"]
            self.boot_s = time.monotonic() - self.started
            log_status_once(self.info.get("confinement"))  # a layer the kernel lacks: one log line

    def _boot_failed(self, stage: str, error: str) -> None:
        """Kill the worker and keep ``error`` for :meth:`wait_ready`.  A start under Landlock that failed by
        itself (not killed by :meth:`close`) before its self-test turns Landlock off for the later workers of
        these settings (:func:`~dice_ray.verify.sandbox.confine.give_up_landlock`)."""
        ended_by_owner = self._killed
        self._boot_error = error
        self.kill()
        if self.landlock and not ended_by_owner:
            give_up_landlock(self.settings, stage, error)

    def _enter(self, announced: str, stage: str, held: str | None,
               background: Callable[[], bool] | None = None, startup: bool = False) -> tuple[str, str | None]:
        """The worker announced stage ``announced`` while in ``stage`` holding ``held``: take the gate
        access it needs (:data:`STAGE_ACCESS`; ``background``, ``startup``: see :meth:`GpuGate.acquire`);
        the same stage again is its next part, and a shared holder first lets waiting timing stages go
        (:meth:`GpuGate.yield_shared`).  Returns ``(stage, held)`` now."""
        if announced == stage and held == "shared" and self.gate is not None:
            self.gate.yield_shared(background, startup)
            return announced, held
        return announced, self._switch_gate(held, STAGE_ACCESS.get(announced, "exclusive"), background, startup)

    def _switch_gate(self, held: str | None, want: str | None,
                     background: Callable[[], bool] | None = None, startup: bool = False) -> str | None:
        """Give back ``held`` gate access and take ``want`` (None: none); returns what is held now."""
        if self.gate is None or want == held:
            return held
        if held is not None:
            self.gate.release(held, startup)
        if want is not None:
            self.gate.acquire(want, background, startup)
        return want

    def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        """Block until the worker says ``ready`` (imports, CUDA init, self-test and limits done).

        Raises:
            WorkerError: it failed, died or took longer than ``timeout_s`` (s).
        """
        self._booting.join(timeout_s)
        if self._booting.is_alive():
            self.kill()
            raise WorkerError(f"verifier worker not ready after {timeout_s:.0f} s; log tail:\n{self.log_tail()}")
        if self._boot_error is not None:
            raise WorkerError(self._boot_error)
        assert self.info is not None
        return self.info

    def run(self, job: dict[str, Any], limits: dict[str, float],
            on_stage: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None) -> JobOutcome:
        """Send a job and wait for its result.  At each stage the worker announces, the gate access
        of :data:`STAGE_ACCESS` is taken (waiting does not count), the worker is told to go, and
        ``limits[stage]`` (s) applies from then on; a stage announced again is its next part: the
        limit keeps running and a shared holder first lets waiting timing stages go
        (:meth:`GpuGate.yield_shared`).  On timeout or death the worker is killed
        (``alive()`` is then False); the gate is always given back.

        ``on_stage(announcement)`` sees each stage announcement before its gate access is taken (the
        previous stage's still held: none after ``load``) and may block (its wait, ``stage_s["on_stage"]``,
        counts against no limit); the fields it returns go with the worker's go (the Verifier passes
        reference facts this way, :mod:`~dice_ray.verify.facts_book`).

        Raises:
            WorkerError: the worker was not ready.
        """
        waited = time.monotonic()
        self.wait_ready(self.settings.get("start_timeout_s", 180.0))
        self.ready_wait_s += time.monotonic() - waited
        stage, held = "load", None
        self.jobs += 1
        spent: dict[str, float] = {}
        mark = time.monotonic()

        def outcome(kind: str, **kw: Any) -> JobOutcome:
            spent[stage] = spent.get(stage, 0.0) + time.monotonic() - mark
            return JobOutcome(kind, stage, stage_s={k: round(v, 4) for k, v in spent.items()}, **kw)

        try:
            try:
                write_frame(self._w, {"op": "job", **job})
            except OSError:
                return outcome("died", detail=self._death())
            deadline = time.monotonic() + max(limits.values())
            while True:
                try:
                    msg = self._reader.read(max(0.0, deadline - time.monotonic()))
                except ProtocolError as e:
                    detail = self._death() if "closed" in str(e) else f"bad message from the worker: {e}"
                    self.kill()
                    return outcome("died", detail=detail)
                if msg is None:
                    self.kill()
                    return outcome("timeout", detail=f"stage {stage!r} ran past its {limits.get(stage, 0):.0f} s limit")
                if msg.get("type") == "stage":
                    now = time.monotonic()
                    spent[stage] = spent.get(stage, 0.0) + now - mark
                    again = str(msg.get("stage")) == stage  # a stage announced again: its next part
                    extra = None
                    if on_stage is not None:
                        extra = on_stage(msg)
                        spent["on_stage"] = spent.get("on_stage", 0.0) + time.monotonic() - now
                    asked = time.monotonic()
                    stage, held = self._enter(str(msg.get("stage")), stage, held)
                    mark = time.monotonic()
                    spent["gate_wait"] = spent.get("gate_wait", 0.0) + mark - asked
                    try:
                        write_frame(self._w, {"op": "go", **(extra or {})})
                    except OSError:
                        return outcome("died", detail=self._death())
                    # a stage's limit runs from its first part; waiting for the gate or on_stage does not count
                    deadline = (deadline + mark - now if again else
                                time.monotonic() + limits.get(stage, max(limits.values())))
                elif msg.get("type") == "result":
                    if msg.get("fatal"):
                        # the fault that broke the context stalled the whole GPU (~150 ms on an H200) and is
                        # over; the worker waits to be ended: the gate goes back and it is stopped, and its
                        # owner kills it now or in its idle time (the exit stalls other workers' allocations)
                        held = self._switch_gate(held, None)
                        reserved = msg.get("gpu_reserved_mib")
                        self.reserved_mib = float(reserved) if isinstance(reserved, (int, float)) else None
                        self.suspend()
                    return outcome("result", result=msg)
        finally:
            self._switch_gate(held, None)

    def suspend(self) -> None:
        """Stop the worker's process group (SIGSTOP), to be killed later by :meth:`kill` or :meth:`close`:
        a worker whose CUDA context a fault broke keeps the context (and its GPU memory) until then, and
        its exit, the context torn down, stalls other processes' ``cudaMalloc``/``cudaFree`` by ~35 ms
        on an H200 (``benchmarks/gpu_fault_stall.py --victim-alloc``).  ``alive()`` is False from now on."""
        if self.proc.poll() is None and not self._killed:
            self.suspended = True
            try:
                os.killpg(self.proc.pid, signal.SIGSTOP)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()

    def kill(self, wait: bool = True) -> None:
        """Kill the worker's process group (SIGKILL); ``wait``: until it exited (at most 30 s), else
        return at once (``alive()`` is False from now on; :meth:`close` reaps it)."""
        if self.proc.poll() is None:
            self._killed = True
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
            if not wait:
                return
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass

    def close(self) -> None:
        """Ask a ready worker to exit (kill it if it does not within 5 s; one still starting is killed at
        once: it reads no request until its start-up ends, seconds of torch import and CUDA set-up), wait
        for its start-up thread to end, close its pipes and remove its folder.  Only the first call acts (a
        second would close pipe descriptor numbers another thread may have reused)."""
        with self._closing:
            if self._closed:
                return
            self._closed = True
        if self.alive() and self.ready:
            try:
                write_frame(self._w, {"op": "exit"})
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()
        # the start-up thread reads and writes these pipes: it ends first (a spare closed while it waits for
        # the verifier's idle time would otherwise, once let in, use descriptor numbers other pipes now hold)
        if self._booting is not threading.current_thread():
            self.promote()
            self._booting.join(30)
        if not self._booting.is_alive():  # else still held at the gate after 30 s: leak the two descriptors
            for fd in (self._w, self._reader.fd):
                try:
                    os.close(fd)
                except OSError:
                    pass
        shutil.rmtree(self.workdir, ignore_errors=True)
