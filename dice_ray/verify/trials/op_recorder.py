"""The dispatch mode that sees every aten op of the candidate's forward: rule ``forward-torch-op`` at run time.

:class:`OpRecorder` runs around the candidate's forward in the correctness trials and the compile-only dry run
(:mod:`dice_ray.verify.trials.correctness_trials`): ops outside :data:`ALLOWED_ATEN_OPS` (allocation, views,
fills, copies) are ``forward-torch-op``, pinned host allocations ``host-memory``, and the values forward reads
onto the host are kept (:class:`~dice_ray.verify.trials.host_reads.HostReadLog`) for the kernel ablation's
replay (:mod:`dice_ray.verify.trials.ablation`).
"""

from __future__ import annotations

from typing import Any

import torch

from dice_ray.verify.trials.host_reads import HostReadLog, TextHookedMode, host_read_kind

__all__ = ["ALLOWED_ATEN_OPS", "OpRecorder", "warm_imports"]

#: aten ops a candidate's forward may run outside its kernels (allocation, views, fills, copies).
ALLOWED_ATEN_OPS: frozenset[str] = frozenset(
    {
        "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full",
        "zeros", "zeros_like", "ones", "ones_like", "full", "full_like", "zero_", "fill_", "copy_", "clone",
        "view", "_unsafe_view", "_reshape_alias", "reshape", "as_strided", "t", "transpose", "permute", "expand",
        "unsqueeze", "squeeze", "select", "slice", "narrow", "split", "split_with_sizes", "chunk", "unbind",
        "detach", "alias", "lift_fresh", "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel",
        "sym_storage_offset", "is_contiguous", "unflatten", "flatten", "contiguous", "resolve_conj", "resolve_neg",
    }
)


def _upload(name: str, args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether an aten call copies host values to the device (``_to_copy`` of a CPU tensor to a device:
    ``torch.tensor(sizes, device=...)``, in Python or host C++), as an allocation and a ``copy_`` may."""
    target = kwargs.get("device")
    return (name == "_to_copy" and bool(args) and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu"
            and target is not None and torch.device(target).type not in ("cpu", "meta"))


class OpRecorder(TextHookedMode):
    """Records the aten ops run under it that are not in :data:`ALLOWED_ATEN_OPS` nor a host read nor an upload
    (``forbidden``; :func:`~dice_ray.verify.trials.host_reads.host_read_kind`: a one-element ``.cpu()`` is a read,
    ``torch.tensor(values, device=...)`` an upload), the values
    the code read onto the host (``host_reads``: a :class:`~dice_ray.verify.trials.host_reads.HostReadLog`'s ``reads``,
    tensor texts among them), for the kernel ablation's replay; the ops that allocated pinned host memory
    (``pinned``: rule ``host-memory``, which a kernel given its address writes); and the dtype conversions among the
    forbidden ops (``casts``: ``"torch.float32 -> torch.float16"`` for the ``_to_copy`` of ``x.half()``; a cast to
    the dtype its input has runs no aten op at all), for the message."""

    def __init__(self) -> None:
        super().__init__()
        self.forbidden: list[str] = []
        self.pinned: list[str] = []
        self.casts: list[str] = []
        self._log = HostReadLog()
        self.host_reads = self._log.reads
        self._on_text = self._log.record_text

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        name = func.overloadpacket.__name__
        kwargs = kwargs or {}
        if (name not in ALLOWED_ATEN_OPS and name not in self.forbidden and host_read_kind(name, args, kwargs) is None
                and not _upload(name, args, kwargs)):
            self.forbidden.append(name)  # a host read (one element's .cpu()) is replayed, not refused
        if name == "_to_copy" and args and isinstance(args[0], torch.Tensor) and kwargs.get("dtype") not in (
                None, args[0].dtype) and host_read_kind(name, args, kwargs) is None and not _upload(name, args, kwargs):
            cast = f"{args[0].dtype} -> {kwargs['dtype']}"
            if cast not in self.casts:
                self.casts.append(cast)
        if kwargs.get("pin_memory") and name not in self.pinned:
            self.pinned.append(name)
        out = func(*args, **kwargs)
        self._log.note(name, args, out, kwargs)
        return out


def warm_imports() -> None:
    """Import on the CPU what a first job would import lazily: entering a ``TorchDispatchMode``
    (:class:`OpRecorder`) pulls in ``torch._dynamo``, sympy and ~800 more modules (1-5 s).  The fork
    server calls this, so workers forked from it start with them loaded.  Touches no GPU."""
    with OpRecorder(), torch.no_grad():
        (torch.ones(4) + 1).sum()
