"""Compile-only mode's run: the reference and the candidate's ``forward`` on meta tensors, launches checked.

Without a GPU the worker still builds ``ModelNew`` on the CPU, checks the kernel names the source uses, and runs
``forward`` on meta tensors with every kernel call's arguments checked but nothing launched (the dry run); meta
stands for the GPU (:class:`~dice_ray.verify.trials.meta_device.MetaStandsForDevice`).  What meta itself or the
machine's lack of CUDA stops is inconclusive (noted), not a crash; correctness, speed and the run-time rules are
a GPU verifier's.
"""

from __future__ import annotations

from typing import Any

import torch

from dice_ray import launch
from dice_ray.verify.trials.correctness import flatten_outputs
from dice_ray.verify.trials.meta_device import MetaStandsForDevice, cuda_unavailable
from dice_ray.verify.trials.outcome import JobResult, ReferenceError_, RuleBroken, error_text
from dice_ray.verify.trials.values import clone, seed_all

__all__ = ["DryRun"]

#: words of an error on meta tensors that may come from meta itself (no data, no CUDA, a tensor the code made on
#: another device), not from the code; matched case-insensitively, and a doubt counts for the reference
_META_ARTEFACTS = ("meta", "data pointer", "storage", "cuda", "notimplementederror", "not allocated", "device", "nvidia")


def _meta_inconclusive(exc: BaseException) -> bool:
    """Whether ``exc``, raised by code run on meta tensors on a machine without a GPU, may be meta's
    doing (an op without a meta kernel, a data access, a ``.cuda()`` call) rather than the code's."""
    text = exc.message if isinstance(exc, ReferenceError_) else f"{type(exc).__name__}: {exc}"
    return isinstance(exc, NotImplementedError) or any(w in text.lower() for w in _META_ARTEFACTS)


class DryRun:
    """Compile-only mode's part of a job, a part of :class:`~dice_ray.verify.trials.harness.Harness`.

    Reads the harness's ``settings`` (``seed``, ``dry_run``) and ``input_seed``; calls its ``_inputs``
    (:class:`~dice_ray.verify.trials.reference.ReferenceRuns`), ``_model_new`` and ``_call_candidate``
    (:class:`~dice_ray.verify.trials.correctness_trials.CorrectnessTrials`).
    """

    def _reference_on_meta(self, ref: dict, init_inputs: list) -> tuple[list[Any] | None, Any, str]:
        """Compile-only's reference check, run in the ``reference`` stage before the candidate's model is
        built (so a reference that hangs or whose ``get_init_inputs()`` does not fit its ``Model`` is the
        reference's fault, not the candidate's): ``Model(*init_inputs)``, ``get_inputs()`` and ``forward``
        on meta tensors.  An error that may come from meta itself (:func:`_meta_inconclusive`: no data, no
        CUDA) skips what needs it.

        Returns:
            ``(inputs, expected, note)``: trial 0's inputs on meta (None when ``get_inputs()`` does not
            run on meta), the reference's output on them (None when it cannot be had on meta) and what
            was skipped, for the dry run's note ("" when nothing was).
        Raises:
            ReferenceError_: ``reference-build``, ``reference-inputs``, ``reference-run`` or
                ``reference-output``: an error that is the reference's own (verdict ``invalid_input``).
        """
        meta = torch.device("meta")
        seed_all(self.settings["seed"])
        try:
            with meta:
                ref_model = ref["Model"](*init_inputs)
        except Exception as e:  # noqa: BLE001
            if not _meta_inconclusive(e):
                raise ReferenceError_("reference-build", f"Model(*get_init_inputs()) failed: {error_text(e)}") from None
            ref_model = None
        try:
            inputs = self._inputs(ref, self.input_seed + 1, meta)
        except ReferenceError_ as e:
            if not _meta_inconclusive(e):
                raise
            return None, None, "dry run skipped (the reference's get_inputs() does not run on meta tensors)"
        unrunnable = "dry run ok (reference not runnable on meta: output shapes unchecked)"
        if ref_model is None:
            return inputs, None, unrunnable
        try:
            with meta, torch.no_grad():
                expected = ref_model(*[clone(x) for x in inputs])
        except Exception as e:  # noqa: BLE001
            if not _meta_inconclusive(e):
                raise ReferenceError_("reference-run", f"Model.forward failed (on meta tensors): {error_text(e)}") from None
            return inputs, None, unrunnable
        leaves = flatten_outputs(expected)
        if not leaves or not all(isinstance(o, (torch.Tensor, int, float, bool)) for o in leaves):
            raise ReferenceError_("reference-output", f"Model.forward returned {type(expected).__name__}, not Tensor(s)")
        return inputs, expected, ""

    def _compile_only(self, cand: dict, init_inputs: list, refs: dict[str, set[str]],
                      on_meta: tuple[list[Any] | None, Any, str]) -> JobResult:
        """ModelNew built on the CPU, its kernel names checked, then (``dry_run``) :meth:`_dry_run` against
        :meth:`_reference_on_meta`'s ``on_meta``."""
        model = self._model_new(cand, init_inputs, refs)
        if isinstance(model, JobResult):
            return model
        note = "compiled; ModelNew built on CPU"
        if self.settings.get("dry_run", True):
            outcome = self._dry_run(model, *on_meta)
            if isinstance(outcome, JobResult):
                return outcome
            note += f"; {outcome}"
        return JobResult("ok", compiled=True, reason=f"{note} (compile-only: correctness, speed and the run-time "
                         "anti-cheat rules not measured; a GPU verifier checks them)")

    def _dry_run(self, model: Any, inputs: list[Any] | None, expected: Any, skipped: str) -> JobResult | str:
        """forward on the reference's meta ``inputs`` with launches checked, not run, and its outputs'
        shapes and dtypes checked against ``expected`` (:meth:`_reference_on_meta`); returns a note or a
        verdict (``skipped``: the note when the reference could not give inputs or ``expected``).  Meta stands
        for the GPU (:class:`~dice_ray.verify.trials.meta_device.MetaStandsForDevice`: ``x.cuda()`` is a no-op), and
        what the machine's lack of CUDA stops is inconclusive, not a crash."""
        if inputs is None:
            return skipped
        try:
            model = model.to(torch.device("meta"))
        except Exception as e:  # noqa: BLE001
            return f"dry run skipped (ModelNew does not move to meta tensors: {type(e).__name__})"
        launch.configure(dry_run=True)
        try:
            with MetaStandsForDevice():  # x.cuda(), device="cuda": meta is the device here
                out = self._call_candidate(model, inputs, record=True)
        except RuleBroken:
            raise
        except Exception as e:  # noqa: BLE001
            msg = str(e)
            if isinstance(e, NotImplementedError) or any(w in msg for w in ("meta", "data pointer", "storage")):
                return f"dry run inconclusive ({type(e).__name__} on meta tensors)"
            if cuda_unavailable(e):  # torch.cuda.current_device() and the like on a machine without CUDA
                return f"dry run inconclusive (forward asks for CUDA, which this machine lacks: {type(e).__name__})"
            return JobResult("crash", compiled=True, reason=f"dry run of forward (meta tensors, launches checked): "
                             f"{error_text(e)}")
        finally:
            launch.configure(dry_run=False)
        if expected is None:
            return skipped
        outs, exps = flatten_outputs(out), flatten_outputs(expected)
        if len(outs) != len(exps):
            return JobResult("incorrect", compiled=True, correct=False,
                             reason=f"dry run: forward returned {len(outs)} outputs, the reference {len(exps)}")
        for i, (o, r) in enumerate(zip(outs, exps)):
            if isinstance(r, torch.Tensor):
                if not isinstance(o, torch.Tensor) or tuple(o.shape) != tuple(r.shape) or o.dtype != r.dtype:
                    got = f"{tuple(o.shape)} {o.dtype}" if isinstance(o, torch.Tensor) else type(o).__name__
                    return JobResult("incorrect", compiled=True, correct=False,
                                     reason=f"dry run: output {i} is {got}, expected {tuple(r.shape)} {r.dtype}")
        return "dry run ok (launch arguments and output shapes checked on meta tensors)"
