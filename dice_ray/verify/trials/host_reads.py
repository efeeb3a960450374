"""Values a candidate's forward reads onto the host: recorded in one call, replayed in the kernel ablation's.

The kernel ablation (rule ``kernel-not-used``, :meth:`dice_ray.verify.trials.ablation.KernelAblation._ablate`) runs forward
once with its kernels skipped.  A forward that reads a flag its kernel sets (``flag.item()``, a copy into a
host tensor, ``str(flag)``) could tell that call from a real one and raise or return garbage, leaving the ablation nothing
to judge.  So the harness keeps the host reads of each recorded call (:class:`HostReadLog`, filled by its
:class:`~dice_ray.verify.trials.op_recorder.OpRecorder`) and answers the ablated call's with them
(:class:`HostReadReplay`).  Reads of the call's own inputs are answered live: a forward that computes its
outputs on the host from its inputs (a loss summed from a host copy's ``tolist()``) computes this call's answer and is
caught; a forward that builds its outputs from what its kernels wrote gets the previous call's values.

What counts as a host read (the first :data:`MAX_READS` of a call): aten ``_local_scalar_dense`` (``item()``,
``bool()``, ``int()``, ``float()``), a device-to-host ``copy_`` into a host tensor of at most
:data:`MAX_COPY_BYTES`, a ``_to_copy`` of a one-element device tensor to the CPU (``x.cpu().item()``, in
Python or host C++: the one value ``item()`` reads), and the text of a tensor (``repr``, ``str``, ``format``:
torch formats with dispatch modes off, so it is caught at ``torch._tensor_str._str``).  ``.tolist()``,
``.cpu()`` and ``.to("cpu")`` of a larger device tensor are aten ``_to_copy`` too (measured on an H200), which
forward may not run (``forward-torch-op``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch._tensor_str

__all__ = ["HOST_DEVICE_TYPES", "MAX_COPY_BYTES", "MAX_READS", "HostReadLog", "HostReadReplay", "TextHookedMode",
           "host_read_kind", "on_device", "tensor_text_hook"]

MAX_READS = 64  # host reads of one call kept for the replay
MAX_COPY_BYTES = 2**20  # a copy to the host larger than this is neither kept nor replayed

#: device types whose memory the host reads directly (a CPU test may narrow it to simulate a device)
HOST_DEVICE_TYPES: tuple[str, ...] = ("cpu", "meta")


def on_device(t: Any) -> bool:
    """Whether ``t`` is a tensor in memory the host does not read directly (:data:`HOST_DEVICE_TYPES`)."""
    return isinstance(t, torch.Tensor) and t.device.type not in HOST_DEVICE_TYPES


def host_read_kind(name: str, args: tuple, kwargs: dict[str, Any] | None = None) -> tuple[str, torch.Tensor] | None:
    """The kind of host read an aten op call is, and the tensor it reads; None when it is not one.

    Kinds: ``"scalar"`` (``_local_scalar_dense`` of a device tensor), ``"copy"`` (``copy_(host, device)``),
    ``"to_host"`` (``_to_copy(device, device="cpu")`` of one element: ``x.cpu().item()``).
    A host tensor's own reads are not host reads: what it holds came through a copy, replayed or live.
    """
    if name == "_local_scalar_dense" and on_device(args[0]):
        return "scalar", args[0]
    if name == "copy_" and len(args) >= 2 and args[0].device.type == "cpu" and on_device(args[1]):
        return "copy", args[1]
    target = (kwargs or {}).get("device")
    if (name == "_to_copy" and on_device(args[0]) and args[0].numel() == 1 and target is not None
            and torch.device(target).type == "cpu" and not (kwargs or {}).get("pin_memory")):
        return "to_host", args[0]
    return None


def _small(t: torch.Tensor) -> bool:
    return t.numel() * t.element_size() <= MAX_COPY_BYTES


class HostReadLog:
    """The host reads of one call, in order: ``("scalar", dtype, value)``, ``("copy", host tensor)``,
    ``("to_host", the device tensor)``, ``("text", str)``; at most :data:`MAX_READS` (copies of at most :data:`MAX_COPY_BYTES`)."""

    def __init__(self) -> None:
        self.reads: list[tuple] = []

    def note(self, name: str, args: tuple, out: Any, kwargs: dict[str, Any] | None = None) -> None:
        """Keep the read an aten call ``name(*args, **kwargs) -> out`` made, if it is one (:func:`host_read_kind`)."""
        found = host_read_kind(name, args, kwargs)
        if found is None or len(self.reads) >= MAX_READS:
            return
        kind = found[0]
        if kind == "scalar":
            self.reads.append(("scalar", args[0].dtype, out))
        elif kind == "to_host":
            self.reads.append(("to_host", args[0].clone()))
        elif _small(args[0]):
            self.reads.append(("copy", args[0].clone()))

    def record_text(self, original: Callable[..., str], tensor: torch.Tensor, *args: Any, **kwargs: Any) -> str:
        """The text of ``tensor`` (``original(tensor, *args, **kwargs)``: torch's formatter), kept when the
        tensor is on a device (:func:`tensor_text_hook`'s hook)."""
        text = original(tensor, *args, **kwargs)
        if on_device(tensor) and len(self.reads) < MAX_READS:
            self.reads.append(("text", text))
        return text


@contextlib.contextmanager
def tensor_text_hook(hook: Callable[[Callable[..., str], torch.Tensor, Any, Any], str]) -> Iterator[None]:
    """Route the text of every tensor (``repr``, ``str``, ``format``, f-strings) through
    ``hook(original, tensor, *args, **kwargs)`` inside the block.  torch formats a tensor with dispatch modes
    switched off (``torch._tensor_str._str``), so no :class:`~torch.utils._python_dispatch.TorchDispatchMode`
    sees that read."""
    original = torch._tensor_str._str

    def routed(self: torch.Tensor, *args: Any, **kwargs: Any) -> str:
        return hook(original, self, *args, **kwargs)

    torch._tensor_str._str = routed
    try:
        yield
    finally:
        torch._tensor_str._str = original


class TextHookedMode(torch.utils._python_dispatch.TorchDispatchMode):
    """A dispatch mode that, while active, also routes every tensor's text through ``self._on_text`` (a
    :func:`tensor_text_hook` hook, set by the subclass): the one host read no dispatch mode sees."""

    _on_text: Callable[..., str]

    def __enter__(self) -> TextHookedMode:
        self._text = tensor_text_hook(self._on_text)
        self._text.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._text.__exit__(*exc)


def _storages(tensors: list[Any]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor) and t.numel()}


class HostReadReplay(TextHookedMode):
    """Answers the host reads of the code run under it with a :class:`HostReadLog`'s ``reads``, in order
    within each kind: the n-th scalar read of the recorded dtype gets the n-th recorded scalar, the n-th
    copy (or one-element ``.cpu()``) of the recorded shape and dtype the n-th recorded tensor, the n-th tensor text
    the n-th recorded text.  A read of one of ``live`` (the call's inputs: same storage), past the record,
    or of another dtype or shape, reads the tensor (it still uses up its place in the record).  Every op
    runs as it would without the mode.  ``replayed`` counts the reads answered from the record.

    Raises nothing of its own; ops raise as they would.
    """

    def __init__(self, reads: list[tuple], live: list[Any] = ()) -> None:
        super().__init__()
        self._kept = {kind: [r[1:] for r in reads if r[0] == kind] for kind in ("scalar", "copy", "to_host", "text")}
        self._live = _storages(list(live))
        self.replayed = 0
        self._on_text = self._replay_text

    def _next(self, kind: str, source: torch.Tensor | None) -> tuple | None:
        kept = self._kept[kind]
        if not kept:
            return None
        record = kept.pop(0)
        if source is not None and source.numel() and source.untyped_storage().data_ptr() in self._live:
            return None
        return record

    def _replay_text(self, original: Callable[..., str], tensor: torch.Tensor, *args: Any, **kwargs: Any) -> str:
        if not on_device(tensor):  # not recorded either (OpRecorder keeps device tensors' texts)
            return original(tensor, *args, **kwargs)
        record = self._next("text", tensor)
        if record is None:
            return original(tensor, *args, **kwargs)
        self.replayed += 1
        return record[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        found = host_read_kind(func.overloadpacket.__name__, args, kwargs)
        if found is not None:
            kind, source = found
            record = self._next(kind, source)
            if kind == "scalar" and record is not None and record[0] == args[0].dtype:
                self.replayed += 1
                return record[1]
            if kind == "copy" and record is not None and record[0].shape == args[0].shape \
                    and record[0].dtype == args[0].dtype:
                self.replayed += 1
                return func(args[0], record[0])
            if kind == "to_host" and record is not None and record[0].shape == source.shape \
                    and record[0].dtype == source.dtype:
                self.replayed += 1
                return func(record[0], *args[1:], **kwargs)
        return func(*args, **kwargs)
