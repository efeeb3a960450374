"""The task's reference in the worker: its module loaded, its inputs made, its model built and checked on trial 0.

A reference that fails is the task's fault (:class:`~dice_ray.verify.trials.outcome.ReferenceError_`, verdict
``invalid_input``), never the candidate's.  The first job of a reference also measures its precision facts
(:mod:`dice_ray.verify.trials.reference_facts`: a float64 run) and checks it is deterministic (two runs); a later
job gets the facts from the parent and runs it once.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from dice_ray.verify.trials import bound, reference_facts
from dice_ray.verify.trials.correctness import flatten_outputs
from dice_ray.verify.trials.execution import exec_source
from dice_ray.verify.trials.outcome import JobResult, ReferenceError_, error_text
from dice_ray.verify.trials.reference_facts import ReferenceFacts
from dice_ray.verify.trials.values import clone, finite, same, seed_all

__all__ = ["ReferenceRuns"]


class ReferenceRuns:
    """The reference's part of a job, a part of :class:`~dice_ray.verify.trials.harness.Harness`.

    Reads the harness's ``settings`` (``seed``, ``precision_rtol``), ``mode``, ``device`` / ``dev`` and
    ``input_seed``; calls its ``_restore_torch_state`` and ``_compare``
    (:class:`~dice_ray.verify.trials.correctness_trials.CorrectnessTrials`).
    """

    def _inputs(self, ns: dict[str, Any], seed: int, device: torch.device) -> list[Any]:
        """``get_inputs()`` of the reference namespace ``ns`` under ``seed``, on ``device``.

        Raises:
            ReferenceError_: ``reference-inputs``.
        """
        seed_all(seed)
        try:
            with device:
                raw = ns["get_inputs"]()
            raw = list(raw) if isinstance(raw, (list, tuple)) else [raw]
            return [x.to(device) if isinstance(x, torch.Tensor) else x for x in raw]
        except (Exception, SystemExit) as e:  # noqa: BLE001 - sys.exit() in a reference is its failure
            raise ReferenceError_("reference-inputs", f"get_inputs() failed: {error_text(e)}") from None

    def _load_reference(self, reference_src: str) -> tuple[dict[str, Any], list[Any]]:
        """The reference module's namespace and its ``get_init_inputs()``, with the torch flags restored and
        the GPU synchronized first.

        Raises:
            ReferenceError_: ``reference-exec``.
        """
        self._restore_torch_state()
        if self.mode == "gpu":
            bound.synchronize(self.device)
        try:
            ref = exec_source(reference_src, "<reference>", guarded=False)
            seed_all(self.settings["seed"])
            return ref, list(ref["get_init_inputs"]())
        except (Exception, SystemExit) as e:  # noqa: BLE001 - sys.exit() in a reference is its failure
            raise ReferenceError_("reference-exec", f"reference module or get_init_inputs() failed: {error_text(e)}")

    def _reference_on_trial0(self, ref: dict[str, Any], init_inputs: list[Any],
                             facts: ReferenceFacts | None) -> tuple[Any, list[Any], bool, Any, ReferenceFacts]:
        """``Model(*init_inputs)`` on the GPU (seeded, eval mode), trial 0's inputs (seed ``seed + 1``) and the
        reference checked on them (:meth:`_check_reference`): ``(model, inputs0, mutates, expected0, facts)``.
        One place for a candidate's job and a reference-only job, so both measure the same facts.

        Raises:
            ReferenceError_: ``reference-build``, ``reference-inputs`` or one of :meth:`_check_reference`'s.
        """
        seed_all(self.settings["seed"])
        try:
            with self.dev:
                ref_model = ref["Model"](*init_inputs).to(self.dev).eval()
        except Exception as e:  # noqa: BLE001
            raise ReferenceError_("reference-build", f"Model(*get_init_inputs()) failed: {error_text(e)}") from None
        inputs0 = self._inputs(ref, self.input_seed + 1, self.dev)
        return (ref_model, inputs0, *self._check_reference(ref_model, inputs0, facts))

    def _reference_only(self, job: dict[str, Any], stage: Callable[..., Any]) -> JobResult:
        """A job without a candidate (``reference_only``, :meth:`Verifier.prepare
        <dice_ray.verify.verifier.Verifier.prepare>`): measure the reference's facts on trial 0's inputs, as a
        candidate's first job would, and pass them on with the ``run`` stage's announcement.  Verdict ``ok``
        (nothing was judged; ``reason`` says whether they were measured or already known), or
        ``invalid_input`` naming the reference's broken rule (``reference-*``).  GPU mode only."""
        go = stage("reference")
        if isinstance(go, dict) and go.get("reference_facts"):
            return JobResult("ok", reason="reference facts already known")
        ref, init_inputs = self._load_reference(job["reference_src"])
        *_, facts = self._reference_on_trial0(ref, init_inputs, None)
        stage("run", reference_facts=facts.to_dict())
        return JobResult("ok", reason="reference facts measured")

    def _check_reference(self, ref_model: Any, inputs0: list[Any],
                         facts: ReferenceFacts | None) -> tuple[bool, Any, ReferenceFacts]:
        """Run the reference on trial 0's inputs: it must run, return tensors and be finite; without
        ``facts`` (the first job of this reference) it runs twice, must be deterministic, and its
        precision facts are measured (:func:`~dice_ray.verify.trials.reference_facts.measure`: a float64 run).
        Returns whether it modifies its own inputs (then mutation is not checked), its first output
        (trial 0's expected output: trial 0 does not run the reference again) and the facts (``facts``
        itself when given, else the new ones).

        Raises:
            ReferenceError_: ``reference-run``, ``reference-output``, ``reference-nonfinite``,
                ``reference-nondeterministic``.
        """
        outs = []
        for _ in range(1 if facts is not None else 2):
            args = [clone(x) for x in inputs0]
            try:
                with torch.no_grad():
                    outs.append(ref_model(*args))
                bound.synchronize(self.device)
            except Exception as e:  # noqa: BLE001
                raise ReferenceError_("reference-run", f"Model.forward failed: {error_text(e)}") from None
        leaves = flatten_outputs(outs[0])
        if not leaves or not all(isinstance(o, (torch.Tensor, int, float, bool)) for o in leaves):
            raise ReferenceError_("reference-output", f"Model.forward returned {type(outs[0]).__name__}, not Tensor(s)")
        if not finite(outs[0]):
            raise ReferenceError_("reference-nonfinite", "the reference output has NaN/inf values")
        mutates = not all(same(a, b) for a, b in zip(args, inputs0))
        if facts is None:
            if not self._compare(outs[1], outs[0]).ok:
                raise ReferenceError_("reference-nondeterministic", "two reference runs on the same inputs differ")
            facts = reference_facts.measure(ref_model, inputs0, outs[0], float(self.settings.get("precision_rtol", 0.0)))
        return mutates, outs[0], facts
