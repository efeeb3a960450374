"""What a candidate may import and call: the allow-lists the static rules and the worker's import guard share.

* Imports: only :data:`ALLOWED_IMPORTS` (``torch``, ``torch.nn``, ``torch.nn.functional``, ``math``, ``typing``,
  ``__future__``, ``dice_ray.launch`` for :data:`ALLOWED_LAUNCH_NAMES`); the load_inline format also
  ``torch.utils.cpp_extension``'s ``load_inline`` (:func:`import_allowed`).  Read by the static rules
  (:mod:`dice_ray.verify.rules.python_rules`) and, at run time, by the worker's import guard
  (:mod:`dice_ray.verify.trials.import_guard`).
* Run-time code may call only :data:`ALLOWED_TORCH_CALLS` of torch (allocation, meta queries) and
  :data:`ALLOWED_TENSOR_METHODS` of a tensor (views, sizes, pointers, in-place fills).
"""

from __future__ import annotations

__all__ = ["ALLOWED_IMPORTS", "ALLOWED_LAUNCH_NAMES", "ALLOWED_TENSOR_METHODS", "ALLOWED_TORCH_CALLS", "import_allowed"]

ALLOWED_IMPORTS: frozenset[str] = frozenset(
    {"torch", "torch.nn", "torch.nn.functional", "math", "typing", "__future__", "dice_ray.launch"}
)
ALLOWED_LAUNCH_NAMES: frozenset[str] = frozenset({"load_cuda", "KernelModule", "CompileError"})
ALLOWED_TORCH_CALLS: frozenset[str] = frozenset(
    f"torch.{n}"
    for n in (
        "empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones", "ones_like", "full", "full_like",
        "Size", "device", "finfo", "iinfo", "is_tensor", "numel", "no_grad", "inference_mode", "tensor",
        "cuda.current_device", "cuda.is_available", "cuda.device_count",
    )
)
ALLOWED_TENSOR_METHODS: frozenset[str] = frozenset(
    {
        "contiguous", "view", "view_as", "reshape", "reshape_as", "size", "numel", "dim", "ndimension",
        "nelement", "stride", "data_ptr", "is_contiguous", "element_size", "storage_offset", "get_device",
        "t", "transpose", "permute", "unsqueeze", "squeeze", "flatten", "unflatten", "expand", "expand_as",
        "narrow", "select", "unbind", "split", "chunk", "new_empty", "new_zeros", "new_ones", "new_full",
        "zero_", "fill_", "detach", "item", "tolist", "cuda", "to", "type", "is_floating_point",
        "requires_grad_", "dim_order",
    }
)


def import_allowed(module: str, names: tuple[str, ...] = (), inline: bool = False) -> bool:
    """Whether ``import module`` / ``from module import names`` is on the allow-list; with
    ``inline`` (the load_inline format) also ``torch.utils.cpp_extension`` for ``load_inline``."""
    if inline and module == "torch.utils.cpp_extension":
        return set(names) <= {"load_inline"}
    if inline and module == "torch.utils" and names:
        return names == ("cpp_extension",)
    if module not in ALLOWED_IMPORTS:
        return False
    if module == "dice_ray.launch" and names:
        return all(n in ALLOWED_LAUNCH_NAMES for n in names)
    return True
