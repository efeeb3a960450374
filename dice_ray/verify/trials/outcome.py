"""The typed outcomes of a job in the worker: its result, the errors that decide it, and how an error reads.

A job ends in one :class:`JobResult` (sent as JSON; the parent builds the verdict from it).  Failures are
typed, not recognised by matching exception text: :class:`RuleBroken` (a run-time anti-cheat rule, verdict
``cheat``), :class:`ReferenceError_` (the task's reference failed, ``invalid_input``); :func:`error_text`
writes any other error as the verdict's reason (the candidate's and the reference's own frames only).
"""

from __future__ import annotations

import re
import traceback
from dataclasses import asdict, dataclass
from typing import Any

from dice_ray.verify.candidate.nvrtc import CompileError

__all__ = ["JobResult", "ReferenceError_", "RuleBroken", "error_text", "in_candidate_lines"]


class RuleBroken(Exception):
    """A run-time anti-cheat rule broken by the candidate (``rule`` is an id of
    :data:`dice_ray.verify.rules.catalog.RULES`, ``message`` the verdict's reason)."""

    def __init__(self, rule: str, message: str):
        super().__init__(f"[{rule}] {message}")
        self.rule = rule
        self.message = message

    def __reduce__(self):  # pickles with its own arguments
        return type(self), (self.rule, self.message)


class ReferenceError_(Exception):
    """The task's reference failed (verdict ``invalid_input``; ``rule`` names how: ``reference-*``)."""

    def __init__(self, rule: str, message: str):
        super().__init__(f"[{rule}] {message}")
        self.rule = rule
        self.message = message

    def __reduce__(self):  # pickles with its own arguments
        return type(self), (self.rule, self.message)


@dataclass
class JobResult:
    """The worker's answer for one job (sent as JSON; the parent builds the Verdict from it).

    A field the :class:`~dice_ray.verify.verdict.Verdict` also has means what it says there (the Verdict takes it
    as it is, or decides it: ``Verifier._verdict``); ``parts_s`` and ``fatal`` are the worker's own.
    """

    verdict: str
    compiled: bool = False
    correct: bool | None = None
    speedup: float | None = None
    reason: str = ""
    rule: str | None = None
    ref_ms: float | None = None
    candidate_ms: float | None = None
    ref_spread: float | None = None
    candidate_spread: float | None = None
    compiled_ref_ms: float | None = None
    speedup_compiled: float | None = None
    # host seconds of a stage's parts, named ``stage.part``: the timing stage's (TimingStage._measure), or, when a
    # forward raised, ``run.until_raise`` (its call to the error: ~150 ms for an illegal address on an H200,
    # the GPU-wide fault) and ``run.after_raise`` (the error to this result)
    parts_s: dict[str, float] | None = None
    fatal: bool = False  # the worker must be replaced (sticky CUDA error)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict (what the worker sends)."""
        return asdict(self)


def error_text(exc: BaseException, limit: int = 1500) -> str:
    """``Type: message`` plus the innermost candidate/reference frames, at most ``limit`` characters."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename in ("<candidate>", "<reference>")]
    where = "".join(f"  {f.filename} line {f.lineno}: {(f.line or '').strip()}\n" for f in frames[-3:])
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, CompileError):
        text = str(exc)
    text = f"{text}\n{where}" if where else text
    return text if len(text) <= limit else text[: limit - 20] + "\n...[truncated]"


def in_candidate_lines(exc: CompileError, candidate_src: str) -> CompileError:
    """``exc`` with each ``candidate.cu(N)`` of its log followed by `` [candidate line M]``, the line of the
    candidate's file, when its CUDA source is found there verbatim (a raw string literal; one with escapes is
    not, and ``exc`` is returned as it is).  NVRTC counts lines within the CUDA string."""
    at = candidate_src.find(exc.source) if exc.source else -1
    if at < 0:
        return exc
    first = candidate_src.count("\n", 0, at)  # the file line of the source's line 1, less one
    log = re.sub(r"candidate\.cu\((\d+)\)", lambda m: f"{m.group(0)} [candidate line {first + int(m.group(1))}]",
                 exc.log)
    out = CompileError(log, exc.arch, exc.source)
    out.__traceback__ = exc.__traceback__  # its frames name the load_cuda call
    return out
