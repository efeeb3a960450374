"""The verifier: static rules, then a sandboxed worker that compiles, checks and times a candidate.

Pipeline for one candidate (every call returns exactly one :class:`Verdict`):

1. static anti-cheat rules on the source (:mod:`dice_ray.verify.rules`), in this process;
2. in the persistent sandboxed worker (:mod:`dice_ray.verify.runner`, one per Verifier):
   ``load`` (execute the candidate module: NVRTC compiles, limit ``compile_timeout_s``),
   ``reference`` (execute the reference, build it and run it twice on trial 0: it must run, be
   deterministic and finite, limit ``run_timeout_s``), ``run`` (``correctness_trials`` seeded
   trials, then CUDA-event timing of reference and candidate, limit ``run_timeout_s``);
   see :mod:`dice_ray.verify.harness` for the run-time anti-cheat rules;
3. the reward (:func:`dice_ray.verify.reward.compute_reward`).

A crash, a timeout or a sticky CUDA error kills the worker; a new one is started at once and the
Verifier keeps serving.  In compile-only mode (no GPU) step 2 compiles, builds ``ModelNew`` on
CPU, checks the kernels named in the source exist, and dry-runs ``forward`` on meta tensors.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

from dice_ray.config import RewardConfig, VerifyConfig
from dice_ray.verify.reward import compute_reward
from dice_ray.verify.rules import check_candidate
from dice_ray.verify.runner import JobOutcome, WorkerError, WorkerProcess
from dice_ray.verify.verdict import Verdict

__all__ = ["Verifier"]

_MAX_REASON = 8000


class Verifier:
    """Verifies candidates of one task at a time in a sandboxed worker process.

    Args:
        verify_cfg: :class:`~dice_ray.config.VerifyConfig`.
        reward_cfg: :class:`~dice_ray.config.RewardConfig`.
        device: CUDA ordinal to run on; None: cuda:0 when ``mode`` is ``"gpu"``, or when it is
            ``"auto"`` and ``torch.cuda.is_available()``; otherwise compile-only.

    Attributes:
        mode: ``"gpu"`` or ``"compile_only"``.

    Raises:
        RuntimeError: ``verify_cfg.mode == "gpu"`` and no GPU is visible.
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
        self._settings = {**verify_cfg.model_dump(), "mode": mode, "device": device}
        self._limits = {
            "load": verify_cfg.compile_timeout_s,
            "reference": verify_cfg.run_timeout_s,
            "run": verify_cfg.run_timeout_s,
        }
        self._lock = threading.Lock()
        self._worker: WorkerProcess | None = WorkerProcess(self._settings)
        self._spare: WorkerProcess | None = None
        self.restarts = 0

    # -- worker lifecycle ----------------------------------------------------------------------
    @property
    def worker_pid(self) -> int | None:
        """The current worker's process id (changes after a crash or timeout)."""
        return self._worker.pid if self._worker is not None else None

    def _replace_worker(self) -> None:
        """Swap in the warm spare worker (or a new one) and, with ``spare_worker``, start the next spare.

        The spare is started at the first replacement, not at start-up, so a Verifier that never
        sees a crash runs one process; after one, a crash costs a swap instead of a cold start
        (torch import and CUDA init, ~8 s on an H200 machine).
        """
        if self._worker is not None:
            self._worker.close()
        if self._spare is not None and self._spare.alive():
            self._worker, self._spare = self._spare, None
        else:
            if self._spare is not None:
                self._spare.close()
            self._worker, self._spare = WorkerProcess(self._settings), None
        if self.verify_cfg.spare_worker:
            self._spare = WorkerProcess(self._settings)
        self.restarts += 1

    def close(self) -> None:
        """Stop the worker and remove its temporary folder. The Verifier cannot verify afterwards."""
        with self._lock:
            for worker in (self._worker, self._spare):
                if worker is not None:
                    worker.close()
            self._worker = self._spare = None

    def __enter__(self) -> "Verifier":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- verification --------------------------------------------------------------------------
    def verify(self, task: Any, candidate_src: str, candidate_id: str) -> Verdict:
        """Verify one candidate against ``task.reference_src``.

        Args:
            task: a :class:`dice_ray.tasks.task.Task` (only ``task_id`` and ``reference_src`` are read).
            candidate_src: the fast-format candidate module (INTERFACES.md).
            candidate_id: echoed in the verdict.

        Returns:
            Exactly one :class:`Verdict`; never raises for a bad candidate or reference.
        Raises:
            RuntimeError: the Verifier was closed.
        """
        t0 = time.monotonic()
        with self._lock:
            if self._worker is None:
                raise RuntimeError("Verifier is closed")
            try:
                fields = self._verify(task, candidate_src)
            except Exception as e:  # noqa: BLE001 - an internal failure still yields one verdict
                fields = {"verdict": "crash", "reason": f"internal verifier error: {type(e).__name__}: {e}"}
        return self._verdict(task, candidate_id, fields, time.monotonic() - t0)

    def _verify(self, task: Any, candidate_src: str) -> dict[str, Any]:
        if not isinstance(candidate_src, str):
            return {"verdict": "compile_error", "reason": f"candidate is a {type(candidate_src).__name__}, not source text"}
        report = check_candidate(candidate_src) if self.verify_cfg.static_rules else None
        if report is not None:
            first = report.first()
            if first is not None:
                others = [str(v) for v in report.violations if v is not first][:5]
                reason = str(first) + (f"\nalso: {'; '.join(others)}" if others else "")
                return {"verdict": first.verdict, "reason": reason, "rule": first.rule if first.verdict == "cheat" else None}
        if self._worker is None or not self._worker.alive() or self._worker.jobs >= self.verify_cfg.max_jobs_per_worker:
            self._replace_worker()
        assert self._worker is not None
        job = {
            "task_id": task.task_id,
            "reference_src": task.reference_src,
            "candidate_src": candidate_src,
            "kernel_refs": {k: sorted(v) for k, v in (report.kernel_refs if report else {}).items()},
            "cpu_budget_s": self.verify_cfg.compile_timeout_s + 3 * self.verify_cfg.run_timeout_s + 30,
        }
        try:
            outcome = self._worker.run(job, self._limits)
        except WorkerError as e:
            self._replace_worker()
            return {"verdict": "crash", "reason": f"sandbox worker failed: {e}"}
        if not self._worker.alive():
            self._replace_worker()
        return self._from_outcome(outcome)

    def _from_outcome(self, outcome: JobOutcome) -> dict[str, Any]:
        if outcome.kind == "result":
            r = dict(outcome.result or {})
            kind = r.get("verdict", "crash")
            if kind == "compile_error" and r.get("rule"):
                r["reason"] = f"[{r['rule']}] {r.get('reason', '')}"
            if kind not in ("cheat", "invalid_input"):
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
        return Verdict(
            candidate_id=str(candidate_id),
            task_id=str(getattr(task, "task_id", "?")),
            verdict=kind,
            compiled=compiled,
            correct=correct if kind in ("ok", "incorrect") else None,
            speedup=speedup if kind == "ok" else None,
            reward=reward,
            reason=reason,
            rule=f.get("rule"),
            ref_ms=f.get("ref_ms"),
            candidate_ms=f.get("candidate_ms"),
            ref_spread=f.get("ref_spread"),
            candidate_spread=f.get("candidate_spread"),
            mode=self.mode,
            seconds=seconds,
        )
