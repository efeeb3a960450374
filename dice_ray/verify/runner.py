"""Parent side of the sandbox: one persistent worker process, jobs with per-stage hard timeouts.

The worker (:mod:`dice_ray.verify.worker`) is a ``subprocess`` of ``sys.executable`` in its own
session, with a private temporary folder as cwd, a stripped environment, stdout/stderr to a log
file, and two pipes for :mod:`dice_ray.verify.protocol` frames.  A job that overruns its stage's
limit, or a worker that dies (signal, ``os._exit``, sticky CUDA error), ends with the process
group killed; the caller starts a new worker.  KernelBench runs candidates in the evaluating
process, where one bad kernel poisons every later one: that is the gap this closes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dice_ray.verify.protocol import FrameReader, ProtocolError, write_frame
from dice_ray.verify.sandbox import clean_env

__all__ = ["JobOutcome", "WorkerError", "WorkerProcess"]


class WorkerError(RuntimeError):
    """The worker could not start (its log tail is in the message)."""


@dataclass
class JobOutcome:
    """How a job ended: ``kind`` is ``"result"`` (``result`` holds the worker's JobResult dict),
    ``"timeout"`` or ``"died"``; ``stage`` is the last stage the worker announced; ``detail``
    says how it died or which limit it passed, with the worker log's tail."""

    kind: str
    stage: str
    result: dict[str, Any] | None = None
    detail: str = ""


class WorkerProcess:
    """One sandboxed worker.

    Args:
        settings: passed to the worker (mode, device, arch, limits, tolerances...).
    Raises:
        OSError: the process could not be spawned.
    """

    def __init__(self, settings: dict[str, Any]):
        self.settings = settings
        self.workdir = tempfile.mkdtemp(prefix="dice-ray-worker-")
        self.log_path = Path(self.workdir) / "worker.log"
        req_r, req_w = os.pipe()
        res_r, res_w = os.pipe()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dice_ray.verify.worker", str(req_r), str(res_w), json.dumps(settings)],
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

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, chars: int = 1500) -> str:
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

    def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        """Block until the worker says ``ready`` (imports, CUDA init and limits done).

        Raises:
            WorkerError: it failed, died or took longer than ``timeout_s`` (s).
        """
        if self.info is not None:
            return self.info
        try:
            msg = self._reader.read(timeout_s)
        except ProtocolError:
            self.kill()
            raise WorkerError(f"verifier worker died while starting: {self._death()}") from None
        if msg is None:
            self.kill()
            raise WorkerError(f"verifier worker not ready after {timeout_s:.0f} s; log tail:\n{self.log_tail()}")
        if msg.get("type") != "ready":
            self.kill()
            raise WorkerError(f"verifier worker failed to start:\n{msg.get('error', msg)}")
        self.info = msg["info"]
        return self.info

    def run(self, job: dict[str, Any], limits: dict[str, float], first_stage: str = "load") -> JobOutcome:
        """Send a job and wait for its result, applying ``limits[stage]`` (s) from each stage
        announcement on.  On timeout or death the worker is killed (``alive()`` is then False).

        Raises:
            WorkerError: the worker was not ready.
        """
        self.wait_ready(self.settings.get("start_timeout_s", 180.0))
        stage = first_stage
        self.jobs += 1
        try:
            write_frame(self._w, {"op": "job", **job})
        except OSError:
            return JobOutcome("died", stage, detail=self._death())
        deadline = time.monotonic() + limits[stage]
        while True:
            try:
                msg = self._reader.read(max(0.0, deadline - time.monotonic()))
            except ProtocolError as e:
                detail = self._death() if "closed" in str(e) else f"bad message from the worker: {e}"
                self.kill()
                return JobOutcome("died", stage, detail=detail)
            if msg is None:
                self.kill()
                return JobOutcome("timeout", stage, detail=f"stage {stage!r} ran past its {limits[stage]:.0f} s limit")
            if msg.get("type") == "stage":
                stage = str(msg.get("stage"))
                deadline = time.monotonic() + limits.get(stage, max(limits.values()))
            elif msg.get("type") == "result":
                if msg.get("fatal"):
                    self.kill()
                return JobOutcome("result", stage, result=msg)

    def kill(self) -> None:
        """Kill the worker's process group (SIGKILL) and wait for it."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass

    def close(self) -> None:
        """Ask the worker to exit, kill it if it does not within 5 s, remove its folder."""
        if self.proc.poll() is None:
            try:
                write_frame(self._w, {"op": "exit"})
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()
        for fd in (self._w, self._reader.fd):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self.workdir, ignore_errors=True)
