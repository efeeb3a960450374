"""The rules' catalog: every static and run-time rule by id, the verdict it gives, and what a violation says.

A static rule (:mod:`dice_ray.verify.rules.python_rules`, :mod:`~dice_ray.verify.rules.cpp_rules`,
:mod:`~dice_ray.verify.rules.cuda_text`) reports a :class:`Violation`; :func:`dice_ray.verify.rules.check.check_candidate`
gathers them into a :class:`StaticReport`.  A run-time rule is raised in the sandboxed worker
(:class:`dice_ray.verify.trials.outcome.RuleBroken`) with an id of :data:`RULES` too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = ["RULES", "Rule", "StaticReport", "Violation"]


@dataclass(frozen=True)
class Rule:
    """An anti-cheat (or format) rule: ``id``, the verdict it gives, and what it forbids."""

    id: str
    verdict: Literal["cheat", "compile_error"]
    description: str


RULES: dict[str, Rule] = {
    r.id: r
    for r in [
        Rule("syntax", "compile_error", "the candidate must parse as Python"),
        Rule("no-modelnew", "compile_error", "the candidate must define a top-level class ModelNew with forward()"),
        Rule("unsupported-format", "compile_error",
             "torch.utils.cpp_extension is accepted only as `name = load_inline(...)` at module top level with "
             "constant arguments (the load_inline format, dice_ray.verify.candidate.inline_spec)"),
        Rule("unknown-kernel", "compile_error", "every kernels.<name> the source uses must exist in the compiled module"),
        Rule("try-except", "cheat", "no try/except: a fallback to PyTorch on kernel failure is the classic cheat"),
        Rule("reference-model", "cheat", "no use of the reference class Model (inheriting, calling, naming it)"),
        Rule("base-class", "cheat", "classes may derive only from nn.Module, torch.autograd.Function (module-level "
             "wrappers judged as forward is) or classes of the candidate"),
        Rule("forbidden-import", "cheat", "imports outside the allow-list (os, sys, subprocess, threading, ctypes, ...)"),
        Rule("dynamic-code", "cheat", "no eval/exec/compile/__import__/getattr/setattr/globals/vars or dunder access"),
        Rule("file-access", "cheat", "no open() or other file/network access"),
        Rule("cuda-stream", "cheat", "no CUDA streams, events or graphs: work outside the timed stream is hidden"),
        Rule("torch-internals", "cheat", "no torch._C / torch.ops / torch.compile / torch.jit / torch.backends / jiterator"),
        Rule("patching", "cheat", "no assignment to attributes of modules (torch, time, dice_ray) or global torch settings"),
        Rule("forward-torch-op", "cheat", "run-time code may call only allocation/view torch ops; compute must be in kernels"),
        Rule("forward-module-call", "cheat", "run-time code may not call submodules (self.conv(x)) or .forward"),
        Rule("forward-state", "cheat", "no state across calls (self.x = ..., global, mutable defaults, caches)"),
        Rule("module-state", "cheat", "module top level: imports, defs, classes, constants and load_cuda(...) only"),
        Rule("cuda-library", "cheat", "no cuBLAS / cuDNN / CUTLASS / CuTe / thrust / cuSPARSE / cuFFT / cuSOLVER includes "
             "(load_inline format: allowed with verify.allow_vendor_libraries, NCCL/NVSHMEM never)"),
        Rule("host-memory", "cheat",
             "no memory that kernels write and the host reads outside torch: pinned, mapped or managed memory, "
             "device-to-host cudaMemcpy (a kernel's flag there tells forward whether its kernels ran)"),
        Rule("no-kernel-launch", "cheat", "forward must launch at least one of the candidate's kernels on every call"),
        Rule("kernel-not-used", "cheat",
             "outputs must need the candidate's kernels: right with every kernel launch skipped means torch's "
             "copy/fill ops or the host computed them"),
        Rule("input-mutation", "cheat", "the candidate must not modify its inputs"),
        Rule("output-type", "cheat", "outputs must be plain torch.Tensor objects (no subclasses or lazy objects)"),
        Rule("cpp-torch-op", "cheat",
             "load_inline host C++ may call only allocation/view/metadata ATen APIs (torch::empty, x.size(), "
             "x.data_ptr()...): torch::matmul, at::relu, x.sum() are a fallback to PyTorch"),
        Rule("precision-downgrade", "cheat",
             "fp32 outputs must be as accurate as fp32 math: error against a float64 run of the reference is bounded"),
        Rule("timing-audit", "cheat", "a speedup above the audit bound must hold up when re-timed with the host wall clock"),
    ]
}


@dataclass(frozen=True)
class Violation:
    """One broken rule: ``rule`` (an id of :data:`RULES`), ``message``, source ``line`` (1-based or None)."""

    rule: str
    message: str
    line: int | None = None

    @property
    def verdict(self) -> str:
        """The verdict the rule gives (``"cheat"`` or ``"compile_error"``)."""
        return RULES[self.rule].verdict

    def __str__(self) -> str:
        where = f"line {self.line}: " if self.line else ""
        return f"[{self.rule}] {where}{self.message}"


@dataclass
class StaticReport:
    """Result of :func:`~dice_ray.verify.rules.check.check_candidate`.

    Attributes:
        violations: every broken rule, in source order (empty: the candidate may run).
        kernel_refs: ``variable -> kernel names`` used as ``variable.<name>`` (``kernels.relu_kernel``),
            for the compile-only existence check; ``self.<attr>`` holders appear as ``"self.<attr>"``
            (empty for the load_inline format: its names are checked against ``functions`` here).
        format: ``"fast"`` (load_cuda) or ``"inline"`` (torch's load_inline,
            :mod:`dice_ray.verify.candidate.inline_spec`).
    """

    violations: list[Violation] = field(default_factory=list)
    kernel_refs: dict[str, set[str]] = field(default_factory=dict)
    format: Literal["fast", "inline"] = "fast"

    @property
    def ok(self) -> bool:
        """No rule broken: the candidate may run."""
        return not self.violations

    def first(self) -> Violation | None:
        """The violation that decides the verdict: the first cheat, else the first compile_error rule (a
        cheat in a module that also lacks ``ModelNew`` or cannot be read is still a cheat)."""
        cheats = [v for v in self.violations if v.verdict == "cheat"]
        return (cheats or self.violations or [None])[0]
