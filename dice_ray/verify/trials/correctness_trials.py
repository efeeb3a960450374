"""The correctness trials: seeded inputs, another scale, a size doubled; the candidate checked on each.

In each trial the reference runs first and its outputs stay alive while the candidate runs; before the
candidate the caching allocator's free blocks are filled with 0xFF bytes (NaN in every float type), so a
candidate that returns ``torch.empty`` memory, or leaves elements unwritten, reads NaN.  The candidate's call
(:meth:`CorrectnessTrials._call_candidate`) must launch one of its kernels (``no-kernel-launch``,
:mod:`dice_ray.verify.trials.launches`), run no torch op outside its kernels (``forward-torch-op``,
:class:`~dice_ray.verify.trials.op_recorder.OpRecorder`), allocate no pinned memory (``host-memory``), return
plain tensors (``output-type``) and leave its inputs as they were (``input-mutation``); its outputs are compared
with the reference's (:mod:`dice_ray.verify.trials.correctness`).  Trials: ``correctness_trials`` seeds, then
the inputs at another scale (``scaled_trial``), then a size constant of ``get_inputs`` doubled
(:func:`~dice_ray.tasks.task.shape_constant`): hard-coded shapes fail.  The trial after trial 0 runs the kernel
ablation first (:mod:`dice_ray.verify.trials.ablation`), trial 0 the precision check
(:mod:`dice_ray.verify.trials.precision`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from dice_ray.tasks.sizing import shape_constant
from dice_ray.verify.trials import bound, launches
from dice_ray.verify.trials.ablation import small_copy
from dice_ray.verify.trials.correctness import Comparison, compare_outputs, count_mismatches_batch
from dice_ray.verify.trials.op_recorder import OpRecorder
from dice_ray.verify.trials.outcome import JobResult, ReferenceError_, RuleBroken, error_text
from dice_ray.verify.trials.reference_facts import ReferenceFacts
from dice_ray.verify.trials.values import check_output_types, clone, finite, same

__all__ = ["CorrectnessTrials"]


class CorrectnessTrials:
    """The correctness trials of a job, a part of :class:`~dice_ray.verify.trials.harness.Harness`.

    Reads the harness's ``settings`` (tolerances, ``scaled_trial``, ``shape_trial``), ``device`` / ``dev``;
    keeps the recorded call's host reads and outputs (``_host_reads``, ``_read_outputs``) for the kernel
    ablation and when a forward raised (``_error_at``); calls its ``_inputs``
    (:class:`~dice_ray.verify.trials.reference.ReferenceRuns`), ``_restore_torch_state``, ``_worth_ablating`` /
    ``_ablate`` (:class:`~dice_ray.verify.trials.ablation.KernelAblation`) and ``_check_precision``
    (:class:`~dice_ray.verify.trials.precision.PrecisionCheck`).
    """

    def _poison_free_memory(self) -> None:
        """Fill the caching allocator's free blocks with 0xFF bytes (NaN for every float type)."""
        from cuda.bindings import driver

        stream = driver.CUstream(torch.cuda.current_stream(self.device).cuda_stream)
        for seg in torch.cuda.memory_snapshot():
            if seg.get("device", self.device) != self.device:
                continue
            addr = seg["address"]
            for blk in seg["blocks"]:
                a = blk.get("address", addr)
                if blk["state"] == "inactive" and blk["size"] >= 4:
                    driver.cuMemsetD32Async(driver.CUdeviceptr(a), 0xFFFFFFFF, blk["size"] // 4, stream)
                addr = a + blk["size"]

    def _call_candidate(self, model: Any, args: list[Any], record: bool) -> Any:
        """``model(*args)`` without grad, checked: a launch of the candidate's kernels, and with ``record`` no
        pinned memory, no torch op outside the allowed ones, its host reads kept; plain tensor outputs.

        Raises:
            RuleBroken: ``no-kernel-launch``, ``host-memory``, ``forward-torch-op``, ``output-type``.
        """
        before = launches.count()
        rec = OpRecorder() if record else None
        with torch.no_grad():
            if rec is not None:
                with rec:
                    out = model(*args)
                self._host_reads = rec.host_reads  # for the kernel ablation's replay (_ablate)
                self._read_outputs = small_copy(out) if rec.host_reads else None  # its echo (_ablate)
            else:
                out = model(*args)
        if launches.count() == before:
            raise RuleBroken("no-kernel-launch", "a call of ModelNew.forward launched no kernel of the candidate")
        if rec is not None and rec.pinned:
            raise RuleBroken("host-memory", f"forward allocated pinned host memory ({', '.join(rec.pinned)} with "
                             "pin_memory=True): a kernel given its address writes host memory")
        if rec is not None and rec.forbidden:
            casts = (f" (casts that convert: {', '.join(rec.casts)}; a cast is free only to the dtype its input "
                     "already has: let the kernel read or write that type)") if rec.casts else ""
            raise RuleBroken("forward-torch-op", f"forward ran torch ops outside its kernels: {rec.forbidden}{casts}")
        check_output_types(out)
        return out

    def _tolerances(self) -> dict[str, float]:
        """The comparison's tolerances from the job's settings: ``rtol``, ``atol``, ``half_rtol``, ``half_atol``."""
        return {k: self.settings[k] for k in ("rtol", "atol", "half_rtol", "half_atol")}

    def _compare(self, out: Any, ref: Any) -> Any:
        """:func:`compare_outputs` (its reason on failure), counted first by the fused kernels."""
        tol = self._tolerances()
        counts = count_mismatches_batch([(out, ref)], **tol)
        if not isinstance(counts, tuple) and int(counts[0]) == 0:
            return Comparison(True, "")
        return compare_outputs(out, ref, **tol)

    def _trials(self, ref: dict, seeds: list[int], inputs0: list[Any], reference_src: str,
                notes: list[str]) -> list[tuple[str, Callable[[], list[Any] | None]]]:
        """The correctness trials as ``(label, make_inputs)``: one a seed, then the same inputs at
        another scale (``scaled_trial``), then a size constant doubled (``shape_trial``).
        ``make_inputs`` returns None when the trial cannot apply (noted, skipped)."""
        s, dev = self.settings, self.dev
        trials: list[tuple[str, Callable[[], list[Any] | None]]] = [
            (f"trial {i} (seed {seed})", (lambda: inputs0) if i == 0 else (lambda seed=seed: self._inputs(ref, seed, dev)))
            for i, seed in enumerate(seeds)
        ]
        factor = float(s.get("scaled_trial", 1.0))
        if factor != 1.0:
            scaled_seed = seeds[-1] + 1

            def scaled() -> list[Any]:
                return [x * factor if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                        for x in self._inputs(ref, scaled_seed, dev)]

            trials.append((f"scaled trial (seed {scaled_seed}, floating inputs x{factor:g})", scaled))
        if s.get("shape_trial", True):
            found = shape_constant(reference_src)
            if found is None:
                notes.append("shape trial skipped (no size constant read only by get_inputs)")
            else:
                name, value = found
                shape_seed = seeds[-1] + 2

                def doubled() -> list[Any] | None:
                    ref[name] = 2 * value
                    try:
                        return self._inputs(ref, shape_seed, dev)
                    except ReferenceError_ as e:
                        notes.append(f"shape trial skipped ({name}={2 * value}: {e.message[:120]})")
                        return None
                    finally:
                        ref[name] = value

                trials.append((f"shape trial ({name} {value} -> {2 * value})", doubled))
        return trials

    def _trial(self, model: Any, ref_model: Any, make: Callable[[], list[Any] | None], label: str,
               ref_mutates: bool, precision: ReferenceFacts | None, notes: list[str],
               expected: Any = None, ablate: bool = False) -> JobResult | None:
        """One correctness trial: the reference first (its outputs stay alive; ``expected``: its output on
        these inputs, already computed), then the candidate on NaN-poisoned free memory with cloned
        inputs; returns a failing verdict or None.  ``precision``: the reference's facts on these
        inputs (trial 0), to check the candidate's precision with (:meth:`_check_precision`).
        ``ablate``: run :meth:`_ablate` on these inputs first (the trial after trial 0).

        Seeded trials must run the reference; a scaled or shape trial the reference cannot run (it
        raises or gives NaN/inf) is skipped with a note.
        """
        seeded = label.startswith("trial")
        self._restore_torch_state()  # the candidate may have flipped TF32 & co.: the reference runs as set up
        inputs = make()
        if inputs is None:
            return None
        try:
            if expected is None:
                with torch.no_grad():
                    expected = ref_model(*[clone(x) for x in inputs])
                bound.synchronize(self.device)
        except Exception as e:  # noqa: BLE001
            if seeded:
                raise ReferenceError_("reference-run", f"{label}: Model.forward failed: {error_text(e)}") from None
            notes.append(f"{label.split(' (')[0]} skipped (the reference raised {type(e).__name__})")
            return None
        if not seeded and not finite(expected):
            notes.append(f"{label.split(' (')[0]} skipped (the reference gives NaN/inf there)")
            return None
        ablate = ablate and self._worth_ablating(expected, notes)  # before the fill: its temporaries hold the reference
        self._poison_free_memory()  # one fill serves the ablation's call and this trial's (after it only its own
        # outputs were freed: NaN where its skipped kernels wrote nothing, else what did not match the reference)
        if ablate:
            self._ablate(model, inputs, expected, label, notes)
        pristine = inputs  # never handed to anyone (the reference ran on clones): the copy to compare with
        cand_in = [clone(x) for x in inputs]
        t_call = bound.perf()
        try:
            out = self._call_candidate(model, cand_in, record=True)
            bound.synchronize(self.device)
        except RuleBroken:
            raise
        except Exception as e:  # noqa: BLE001
            self._error_at = bound.perf()
            return JobResult("crash" if seeded else "incorrect", compiled=True, correct=None if seeded else False,
                             reason=f"{label}: forward raised {error_text(e)}",
                             parts_s={"run.until_raise": round(self._error_at - t_call, 5)})
        if not ref_mutates and not all(same(a, b) for a, b in zip(cand_in, pristine)):
            raise RuleBroken("input-mutation", f"{label}: the candidate modified its inputs")
        cmp = self._compare(out, expected)
        if not cmp.ok:
            return JobResult("incorrect", compiled=True, correct=False, reason=f"{label}: {cmp.reason}")
        if precision is not None:
            note = self._check_precision(ref_model, pristine, expected, out, precision)
            if note:
                notes.append(note)
        if not seeded:
            notes.append(f"{label} correct")
        return None
