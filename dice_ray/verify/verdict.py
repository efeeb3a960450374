"""The verifier's typed result: one :class:`Verdict` for every candidate, whatever happened."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

VerdictKind = Literal["ok", "compile_error", "incorrect", "cheat", "crash", "timeout", "invalid_input"]


class Verdict(BaseModel):
    """What the verifier decided about one candidate kernel (INTERFACES.md).

    Attributes:
        candidate_id, task_id: what was verified.
        verdict: ``ok`` (compiled, rule-abiding and, on a GPU, correct), ``compile_error`` (Python
            or NVRTC rejected it; ``reason`` has the log), ``incorrect`` (wrong output),
            ``cheat`` (an anti-cheat rule, named in ``rule``), ``crash`` (exception, fatal
            signal, sticky CUDA error), ``timeout`` (a stage ran past its limit), or
            ``invalid_input`` (the task's reference itself fails; ``rule`` names how).
        compiled: the candidate module ran to the end of its ``load_cuda`` calls (False when a
            static rule stopped it before compiling).
        correct: None when not measured (compile-only mode, or stopped earlier).
        speedup: ``ref_ms / candidate_ms`` (PyTorch eager reference), None when not measured.
        reward: see :func:`dice_ray.verify.reward.compute_reward`.
        reason: human-readable detail (NVRTC log, mismatch statistics, traceback tail, timings).
        rule: the anti-cheat rule id for ``cheat`` (see ``dice_ray.verify.rules.catalog.RULES``), the format rule of
            a ``compile_error`` a rule decided (``syntax``, ``no-modelnew``, ``unsupported-format``,
            ``unknown-kernel``; None for a compiler's error, whose log is in ``reason``), or the
            reference's failure for ``invalid_input``: ``reference-exec`` (module or
            ``get_init_inputs``), ``reference-inputs`` (``get_inputs``), ``reference-build``,
            ``reference-run``, ``reference-output`` (not tensors), ``reference-nonfinite``,
            ``reference-nondeterministic`` (two runs differ), ``reference-timeout``,
            ``reference-crash``, ``reference-invalid`` (no ``task_id`` / ``reference_src``, or a
            reference without ``Model``, ``forward``, ``get_inputs`` ... found by parsing).
        ref_ms, candidate_ms: median CUDA-event (device) time of one forward (ms), L2 flushed
            before each call (see ``dice_ray.verify.trials.timing_stage.TimingStage._measure``).
        ref_spread, candidate_spread: (p75 - p25) / median of those times (dimensionless).
        compiled_ref_ms, speedup_compiled: the same for ``torch.compile(reference)`` when
            ``verify.compile_baseline`` is on (reported, not rewarded).
        mode: ``gpu`` or ``compile_only``.
        seconds: wall time of this verification (s), worker start included when it happened.
        stage_seconds: wall seconds of the static rules (``static``), of a load_inline candidate's build
            (``compile``: nvcc and g++, milliseconds when cached), of each worker stage (``load``, ``reference``,
            ``run``, ``timing``, ``check``) and of waiting for the GPU gate (``gate_wait``); empty when the
            verdict came before the static rules (a malformed task or candidate).
            For an ``ok`` verdict also the timing stage's parts (host seconds): ``timing.probe``
            (call-time probe), ``timing.fill`` (making timed inputs), ``timing.windows`` (the timed
            windows: holds, calls and synchronizes), ``timing.check`` (timed outputs compared),
            ``timing.audit``, ``timing.gpu`` (the timed windows' GPU time), and ``timing.windows.launch`` /
            ``.enqueue`` / ``.wait`` splitting the windows' host time (hold and flush queued once the input
            fills ran; calls queued; release and synchronize).  When the candidate's forward raised in a trial (a
            ``crash``, or ``incorrect`` in a scaled or shape trial): ``run.until_raise`` (the call to
            the error; an illegal address takes ~150 ms on an H200, the fault stalling the whole GPU)
            and ``run.after_raise`` (the error to the verdict).  Every verdict a worker gave: ``cleanup``
            (after the verdict: torch state restored, CUDA health checked, garbage collected; the GPU gate
            still held as the last stage held it).
    """

    model_config = ConfigDict(extra="forbid")

    candidate_id: str
    task_id: str
    verdict: VerdictKind
    compiled: bool
    correct: bool | None
    speedup: float | None
    reward: float
    reason: str
    rule: str | None = None
    ref_ms: float | None = None
    candidate_ms: float | None = None
    ref_spread: float | None = None
    candidate_spread: float | None = None
    compiled_ref_ms: float | None = None
    speedup_compiled: float | None = None
    mode: Literal["gpu", "compile_only"]
    seconds: float
    stage_seconds: dict[str, float] = {}
