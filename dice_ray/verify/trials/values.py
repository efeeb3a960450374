"""What the trials do with the values a forward takes and returns: seed, clone, compare exactly, check them.

:func:`seed_all` seeds the generators a worker uses before ``get_inputs()`` / ``Model(...)``; :func:`clone` copies an
input for one side; :func:`same` is exact equality (NaN equals NaN: input mutation, a kernel ablation's echo);
:func:`finite` and :func:`check_output_types` (rule ``output-type``) check outputs.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from dice_ray.verify.trials import bound
from dice_ray.verify.trials.correctness import flatten_outputs
from dice_ray.verify.trials.outcome import RuleBroken

__all__ = ["check_output_types", "clone", "finite", "same", "seed_all"]


def seed_all(seed: int) -> None:
    """``torch.manual_seed(seed)`` for the generators a worker uses (CPU and CUDA), without seeding
    the uninitialised XPU/MTIA back-ends: torch queues those as lazy calls that format a stack trace,
    0.5 ms each, paid once per timed call's inputs."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)


def clone(x: Any) -> Any:
    """A copy of one input for one side (``Tensor.clone``, else a deep copy)."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    return copy.deepcopy(x)


def same(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are the same value: tensors of one shape and dtype equal element for element
    (NaN equals NaN), other values by ``==`` (True when they cannot be compared)."""
    if isinstance(a, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if bound.equal(a, b):
            return True
        if a.is_floating_point():
            return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001
        return True


def check_output_types(out: Any) -> None:
    """Rule ``output-type``: every output tensor is a plain ``torch.Tensor`` (or ``Parameter``).

    Raises:
        RuleBroken: ``output-type`` (a subclass or a lazy object).
    """
    for i, o in enumerate(flatten_outputs(out)):
        if isinstance(o, torch.Tensor) and type(o) not in (torch.Tensor, torch.nn.Parameter):
            raise RuleBroken("output-type", f"output {i} is a {type(o).__module__}.{type(o).__name__}, not a torch.Tensor")


def finite(out: Any) -> bool:
    """Whether every floating output element is finite (no NaN/inf)."""
    return all(bool(torch.isfinite(o).all()) for o in flatten_outputs(out)
               if isinstance(o, torch.Tensor) and o.is_floating_point())
