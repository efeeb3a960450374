"""Every static rule on a candidate, before anything runs: the verdict's first gate.

:func:`check_candidate` applies the Python rules (:mod:`dice_ray.verify.rules.python_rules`), the CUDA text rules
on the whole module (:mod:`~dice_ray.verify.rules.cuda_text`) and, for the load_inline format, the C++/CUDA rules
of its sources (:mod:`~dice_ray.verify.rules.cpp_rules`), on the
:class:`~dice_ray.verify.candidate.candidate.Candidate` read once at the verifier's entry.
"""

from __future__ import annotations

from dice_ray.verify.candidate.candidate import Candidate
from dice_ray.verify.rules.catalog import StaticReport, Violation
from dice_ray.verify.rules.cpp_rules import check_inline
from dice_ray.verify.rules.cuda_text import check_cuda_source
from dice_ray.verify.rules.python_rules import check_python

__all__ = ["check_candidate"]


def check_candidate(candidate: Candidate | str, *, allow_vendor_libraries: bool | None = None,
                    input_dtypes: frozenset[str] | None = None) -> StaticReport:
    """Apply every static rule to a candidate of either format (reads its parse tree, never executes it).

    Args:
        candidate: the :class:`~dice_ray.verify.candidate.candidate.Candidate` (read once by the verifier), or a
            module's text, read here (:meth:`Candidate.coerce <dice_ray.verify.candidate.candidate.Candidate.coerce>`).
        allow_vendor_libraries: ``VerifyConfig.allow_vendor_libraries``: for the load_inline format,
            vendor math libraries (headers, calls, ``-l`` flags of
            :data:`dice_ray.verify.candidate.inline_spec.VENDOR_LIBRARIES`) are not ``cuda-library`` violations;
            the fast format (NVRTC: device code only, no host library) keeps the rule.  None: the candidate's
            own (False for a text).
        input_dtypes: the dtypes the task's inputs may have (:func:`dice_ray.tasks.sizing.input_dtypes` of its
            reference): a cast to one of them (``.double()`` on a float64 task's input) is left to the run-time op
            check, which refuses one that converts; None (no task): float32 assumed.

    Returns:
        A :class:`~dice_ray.verify.rules.catalog.StaticReport`; ``report.first()`` is the violation that decides
        the verdict (a cheat rule before the ``compile_error`` ones: ``syntax``, ``no-modelnew``,
        ``unsupported-format``, ``unknown-kernel``).
    Raises:
        TypeError: ``candidate`` is neither a Candidate nor a str.
        ValueError: a Candidate read with another ``allow_vendor_libraries`` than the one given.
    """
    candidate = Candidate.coerce(candidate, allow_vendor_libraries=allow_vendor_libraries)
    if candidate.tree is None:
        e = candidate.syntax_error
        line = getattr(e, "lineno", None)
        msg = getattr(e, "msg", str(e))
        return StaticReport([Violation("syntax", f"Python syntax error: {msg}", line)])
    report = check_python(candidate, input_dtypes)
    vendor = candidate.allow_vendor_libraries and report.format == "inline"
    report.violations.extend(check_cuda_source(candidate.source, allow_vendor_libraries=vendor, whole_module=True))
    if report.format == "inline":
        if candidate.spec_error is not None:  # the extensions were not read: which names hold them is not known, nor
            # whether forward launches one (the Python rules' no-kernel-launch); the format error says what to change
            report.violations = [v for v in report.violations if v.rule != "no-kernel-launch"]
        report.violations.extend(check_inline(candidate, report.kernel_refs))
        report.kernel_refs = {}  # checked against the extension's functions there
    report.violations.sort(key=lambda v: v.line or 0)
    return report
