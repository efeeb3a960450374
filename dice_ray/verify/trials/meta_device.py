"""Meta tensors standing for the GPU in the compile-only dry run.

Without a GPU, the verifier dry-runs ``ModelNew.forward`` on meta tensors (shapes and dtypes, no data;
:meth:`dice_ray.verify.trials.dry_run.DryRun._dry_run`).  Honest forwards move or allocate on the GPU by name:
``x.cuda()``, ``x.to("cuda")``, ``x.to(device)``, ``torch.empty(n, device="cuda")``, ``assert x.is_cuda``.
On a GPU those are no-ops or allocations; on a CPU-only torch they raise ("Torch not compiled with CUDA
enabled"), which is the machine's doing, not the candidate's.  :class:`MetaStandsForDevice` answers them
as the GPU would, with meta in its place: a CUDA device named in a torch call becomes ``meta``,
``.cuda()`` of a meta tensor is that tensor, and ``.is_cuda`` of a meta tensor is True.
:func:`cuda_unavailable` tells the errors a CPU-only machine raises for what the mode cannot reach
(``torch.cuda.current_device()``, ``torch.device("cuda")`` handed to code outside torch).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["MetaStandsForDevice", "cuda_unavailable"]

_CUDA_NAME = re.compile(r"^cuda(:\d+)?$")
_IS_CUDA = torch.Tensor.is_cuda  # the descriptor whose __get__ torch hands the mode for ``x.is_cuda``
#: what torch says on a machine without CUDA (a CPU-only build, no driver, no device), lower case
_NO_CUDA = ("not compiled with cuda", "no cuda gpus", "found no nvidia driver", "cuda driver", "no nvidia gpu",
            "cuda is not available", "cudagetdevicecount")


def _meta_for_cuda(value: Any) -> Any:
    """``value`` with a CUDA device (``torch.device("cuda")``, ``"cuda:0"``) made ``meta``; anything else as is."""
    if isinstance(value, torch.device) and value.type == "cuda":
        return torch.device("meta")
    if isinstance(value, str) and _CUDA_NAME.match(value):
        return "meta"
    return value


class MetaStandsForDevice(TorchFunctionMode):
    """Inside the block, torch calls see ``meta`` wherever they name a CUDA device (see the module docstring).

    Only device arguments change: every call still runs (on meta tensors), so a wrong shape or an op without a
    meta kernel still shows.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        first = args[0] if args else None
        if isinstance(first, torch.Tensor) and first.is_meta:
            if func is torch.Tensor.cuda:  # x.cuda(), x.cuda(0), x.cuda(non_blocking=True): already on the device
                return first
            if getattr(func, "__self__", None) is _IS_CUDA:  # the property's getter
                return True
        if func is torch.device and args and _meta_for_cuda(args[0]) != args[0]:
            return torch.device("meta")  # torch.device("cuda", 0): meta has no index
        args = tuple(_meta_for_cuda(a) for a in args)
        kwargs = {k: _meta_for_cuda(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def cuda_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` is a CPU-only machine's refusal of a CUDA request (``torch.cuda.current_device()``
    without CUDA), not an error of the code that made it."""
    return any(w in f"{exc}".lower() for w in _NO_CUDA)
