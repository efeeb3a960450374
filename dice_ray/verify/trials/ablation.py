"""The kernel ablation, rule ``kernel-not-used`` (dice-ray's own): outputs must need the candidate's kernels.

Answers computed by the copy ops forward may run beside a kernel that does nothing (a transpose as
``x.t().contiguous()``, a loss summed from ``tolist()``) pass every other check: so, before the second trial's
call, the candidate runs once on that trial's inputs with every launch of its kernels counted but not run
(:func:`dice_ray.verify.trials.launches.suppressed`); outputs that still match the reference were computed by its
allowed copy/fill ops or on the host, not its kernels.  The values forward reads onto the host in that call,
except its inputs', are the previous trial's (:class:`~dice_ray.verify.trials.host_reads.HostReadReplay`), so a
flag its kernel sets does not tell it.
"""

from __future__ import annotations

from typing import Any

import torch

from dice_ray.verify.trials import bound, launches, mismatch_kernel
from dice_ray.verify.trials.correctness import count_mismatches_batch, fill_could_match, flatten_outputs
from dice_ray.verify.trials.host_reads import HostReadReplay
from dice_ray.verify.trials.outcome import RuleBroken
from dice_ray.verify.trials.values import check_output_types, clone, same

__all__ = ["KernelAblation", "small_copy"]

#: outputs of at most this many bytes are kept for the kernel ablation's echo check (KernelAblation._ablate)
_ECHO_BYTES = 16 * 2**20


def small_copy(out: Any) -> Any:
    """A clone of a forward's outputs when their tensors hold at most :data:`_ECHO_BYTES` in all, else None: what
    a recorded call that read the host keeps for the ablation's echo check (:meth:`KernelAblation._ablate`)."""
    leaves = flatten_outputs(out)
    size = sum(o.numel() * o.element_size() for o in leaves if isinstance(o, torch.Tensor))
    return [clone(o) for o in leaves] if size <= _ECHO_BYTES else None


def _same_outputs(out: Any, kept: list[Any]) -> bool:
    """Whether a forward's outputs are element for element ``kept`` (:func:`small_copy`; NaN equals NaN)."""
    leaves = flatten_outputs(out)
    return len(leaves) == len(kept) and all(
        isinstance(a, torch.Tensor) == isinstance(b, torch.Tensor) and same(a, b) for a, b in zip(leaves, kept))


class KernelAblation:
    """The kernel ablation of a job, a part of :class:`~dice_ray.verify.trials.harness.Harness`.

    Reads the harness's ``settings`` (tolerances), ``device`` and the previous recorded call's ``_host_reads`` /
    ``_read_outputs`` (:meth:`CorrectnessTrials._call_candidate
    <dice_ray.verify.trials.correctness_trials.CorrectnessTrials._call_candidate>`); calls its
    ``_poison_free_memory`` and ``_tolerances``.
    """

    def _worth_ablating(self, expected: Any, notes: list[str]) -> bool:
        """Whether the kernel ablation (:meth:`_ablate`) can tell anything from ``expected``: not when a buffer
        filled with a usual initial value would match every reference output
        (:func:`~dice_ray.verify.trials.correctness.fill_could_match`: all zeros, a loss of exactly 1, ones within the
        tolerance), which an honest ``torch.zeros`` buffer whose kernel did not run would; then a note says so.
        Run before the free memory is poisoned: the comparison's temporaries hold the reference's values."""
        if fill_could_match(expected, **self._tolerances()):
            notes.append("kernel ablation skipped (a filled buffer would match the reference outputs)")
            return False
        return True

    def _ablate(self, model: Any, inputs: list[Any], expected: Any, label: str, notes: list[str]) -> None:
        """Rule ``kernel-not-used`` (dice-ray's own rule: an ablation of the candidate's kernels).

        Runs ``model`` once on clones of ``inputs`` (on the free memory the trial just NaN-poisoned) with
        every launch of its kernels counted but not run (:func:`dice_ray.launch.kernels_suppressed` for
        load_cuda kernels, :func:`dice_ray.verify.trials.inline_launches.kernels_suppressed` for load_inline ones), and
        compares its outputs with ``expected`` (the reference's on ``inputs``).  Forward may run torch's
        allocation/view/copy/fill ops (:data:`ALLOWED_ATEN_OPS`) and ``no-kernel-launch`` only asks for a
        launch, so a data-movement task (transpose, concat, padding) can be answered by
        ``x.t().contiguous()`` next to a kernel that does nothing; outputs that are right without the
        kernels were computed that way.  Nothing changes when the ablated call raises (it needed its
        kernels) or gives wrong outputs.  The trial runs it only where :meth:`_worth_ablating`: a
        one-element output is ablated unless a usual initial fill matches it, so a scalar (a loss) computed on
        the host next to a kernel that does nothing is caught.  Its outputs are compared by counts alone
        (no copy of the reference is left in the free memory the trial's own call allocates from).  Values
        forward reads onto the host (``item()``, a copy to a host tensor, ``str()``) are answered with those
        of the previous trial's call
        (:class:`~dice_ray.verify.trials.host_reads.HostReadReplay`), except reads of its inputs, which are live: a
        forward that checks a flag its kernel sets, and raises or returns garbage when the flag is clear,
        cannot tell the ablated call from a real one, and one that computes on the host from its inputs
        computes this call's answer.  A forward whose outputs need its kernels gets wrong outputs (the
        replayed values are another input's) or, when it builds them on the host from replayed values
        alone, exactly its previous call's outputs: that echo is inconclusive (noted), not a cheat, even
        where the two trials' answers agree within tolerance (a loss over inputs of one distribution).

        The harness runs it in the trial after trial 0, before that trial's own call, on that trial's
        inputs: the candidate has not seen them, so no buffer it kept (an output buffer made in
        ``__init__`` and reused) holds their answer, and trial 0's call already did any first-call set-up.

        Raises:
            RuleBroken: ``kernel-not-used``.
            RuntimeError: a load_inline extension could not set or clear its kernel switch.
        """
        cand_in = [clone(x) for x in inputs]
        with launches.suppressed():
            try:
                with torch.no_grad(), HostReadReplay(self._host_reads, live=cand_in) as replay:
                    out = model(*cand_in)
                bound.synchronize(self.device)
                check_output_types(out)
            except (Exception, SystemExit):  # noqa: BLE001 - it needed its kernels: no verdict from this run
                return
        if replay.replayed and self._read_outputs is not None and _same_outputs(out, self._read_outputs):
            notes.append("kernel ablation inconclusive (forward rebuilt its previous call's outputs from the "
                         "host reads replayed to it)")
            return
        counts = count_mismatches_batch([(out, expected)], **self._tolerances())  # counts only: compare_outputs copies the reference
        if not all(mismatch_kernel.supported(o, r) for o, r in zip(flatten_outputs(out), flatten_outputs(expected))
                   if isinstance(r, torch.Tensor) and r.numel()):
            self._poison_free_memory()  # the batched comparison stacked copies of the reference, since freed
        if not isinstance(counts, tuple) and int(counts[0]) == 0:
            raise RuleBroken("kernel-not-used",
                             f"{label}: with every launch of the candidate's kernels counted but not run, forward's "
                             "outputs still match the reference: its torch copy/fill ops or the host computed them, "
                             "not its kernels")
