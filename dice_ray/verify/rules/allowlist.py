"""What a candidate may import and call: the allow-lists the static rules and the worker's import guard share.

* Imports: only :data:`ALLOWED_IMPORTS` (``torch``, ``torch.nn`` and its ``init``, ``modules.utils``, ``parameter``,
  ``torch.nn.functional``, ``math``, ``typing``, ``itertools``, ``collections``, ``numbers``, ``__future__``,
  ``dice_ray.launch`` for :data:`ALLOWED_LAUNCH_NAMES`; each entry's reason beside it), ``Function`` (and
  ``once_differentiable``) from ``torch.autograd``; the load_inline format also ``torch.utils.cpp_extension``'s
  ``load_inline`` (:func:`import_allowed`).  Read by the static rules
  (:mod:`dice_ray.verify.rules.python_rules`) and, at run time, by the worker's import guard
  (:mod:`dice_ray.verify.trials.import_guard`).
* Run-time code may call only :data:`ALLOWED_TORCH_CALLS` of torch (allocation, meta queries) and
  :data:`ALLOWED_TENSOR_METHODS` of a tensor (views, sizes, pointers, in-place fills).
"""

from __future__ import annotations

__all__ = ["ALLOWED_IMPORTS", "ALLOWED_LAUNCH_NAMES", "ALLOWED_TENSOR_METHODS", "ALLOWED_TORCH_CALLS", "CALLABLE_ARGUMENTS",
           "import_allowed"]

#: Modules a candidate may import: an explicit list, each entry for a reason.  Not "whatever the task's reference
#: imports": a reference is trusted code and may import ``os``, ``numpy`` (files: ``np.load``, ``np.ctypeslib``) or
#: ``einops`` (torch ops under other names); a module is on the list only when nothing in it reaches files,
#: processes, threads, the network, ``ctypes``, ``importlib`` or code in strings, and its functions that call a
#: callable they are handed are judged like ``map`` in run-time code (:data:`CALLABLE_ARGUMENTS`).
ALLOWED_IMPORTS: frozenset[str] = frozenset(
    {
        "torch", "torch.nn", "torch.nn.functional",  # what the task is written in; compute calls judged by where
        "dice_ray.launch",  # the fast format's loader (only ALLOWED_LAUNCH_NAMES)
        "__future__",  # annotations
        "math",  # scalar math on Python numbers
        "typing",  # annotations (its string-evaluating helpers are refused: rule dynamic-code)
        # submodules of torch.nn that KernelBench solutions import for weight set-up: the functions nn.init runs are
        # torch ops, judged by where they run (allowed in __init__ and what only __init__ calls, refused at run
        # time), as through ``nn.init``; modules.utils holds the tuple helpers nn.Conv*d use (_single, _pair,
        # _triple, _quadruple: ``tuple(repeat(x, n))``); parameter holds nn.Parameter itself
        "torch.nn.init", "torch.nn.modules.utils", "torch.nn.parameter",
        # pure helpers of the standard library that KernelBench references import (level3 SwinMLP: itertools.repeat,
        # collections.abc.Iterable in its _ntuple): iterators and containers, no I/O; itertools' functions that
        # call what they are handed (starmap, accumulate...) are CALLABLE_ARGUMENTS; a counter kept on self
        # (itertools.count) and advanced at run time is rule forward-state (next(self.c))
        "itertools", "collections", "collections.abc",
        "numbers",  # abstract number types (isinstance(k, numbers.Integral)): classes only
    }
)
#: Not on the list, though pure-looking: ``functools`` (``partial``/``reduce`` call what they are handed where the
#: rules cannot follow, ``lru_cache``/``cache`` are caches across calls), ``operator`` (``attrgetter``/
#: ``methodcaller`` are getattr by a string, ``setitem``/``iadd`` mutate state unseen, ``call`` calls anything,
#: ``matmul`` is ``@``), ``dataclasses`` (its decorator is not an allowed one; reaches ``sys``/``inspect``), none
#: of which a KernelBench reference imports.

#: Import-rooted functions of the allowed modules that call a callable they are handed, and where it is: positional
#: indices and keyword names.  In run-time code what is handed must be something the rules see, as for ``map``
#: (rule forward-module-call: ``itertools.starmap(self.conv, args)`` calls a submodule unseen).
CALLABLE_ARGUMENTS: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {
    "itertools.starmap": ((0,), ()), "itertools.accumulate": ((1,), ("func",)),
    "itertools.filterfalse": ((0,), ()), "itertools.takewhile": ((0,), ()), "itertools.dropwhile": ((0,), ()),
    "itertools.groupby": ((1,), ("key",)), "collections.defaultdict": ((0,), ("default_factory",)),
}
#: ``from torch.autograd import Function``: the base of a ``torch.autograd.Function`` wrapper (its methods judged as
#: forward is, python_rules), and backward's ``once_differentiable`` decorator; only these names of those modules
#: (``torch.autograd.grad`` and the rest are torch compute)
_FUNCTION_IMPORTS: dict[str, frozenset[str]] = {
    "torch.autograd": frozenset({"Function"}),
    "torch.autograd.function": frozenset({"Function", "once_differentiable"}),
}
ALLOWED_LAUNCH_NAMES: frozenset[str] = frozenset({"load_cuda", "KernelModule", "CompileError"})
ALLOWED_TORCH_CALLS: frozenset[str] = frozenset(
    f"torch.{n}"
    for n in (
        "empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones", "ones_like", "full", "full_like",
        "Size", "device", "finfo", "iinfo", "is_tensor", "numel", "no_grad", "inference_mode", "tensor",
        "cuda.current_device", "cuda.is_available", "cuda.device_count",
        # tuple helpers of nn.Conv*d (``tuple(repeat(x, n))`` unless x is iterable): no tensor, no op
        "nn.modules.utils._single", "nn.modules.utils._pair", "nn.modules.utils._triple",
        "nn.modules.utils._quadruple",
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
    if module in _FUNCTION_IMPORTS:
        return bool(names) and set(names) <= _FUNCTION_IMPORTS[module]
    if module not in ALLOWED_IMPORTS:
        return False
    if module == "dice_ray.launch" and names:
        return all(n in ALLOWED_LAUNCH_NAMES for n in names)
    return True
