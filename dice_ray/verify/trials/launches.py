"""The candidate's kernel launches as the trials see them, both formats: counted, and switched off together.

Run-time rule ``no-kernel-launch`` (every call of ``ModelNew.forward`` launches at least one of the candidate's
own kernels) reads :func:`count`: the launches of ``load_cuda`` kernels (:func:`dice_ray.launch.launch_count`)
plus the host launch counters of the candidate's load_inline extensions
(:func:`dice_ray.verify.trials.inline_launches.launch_count`); no CUDA call, so it may be read inside a timed
window.  Rule ``kernel-not-used`` (the kernel ablation, :mod:`dice_ray.verify.trials.ablation`) runs a call
inside :func:`suppressed`: every launch of either format counted, none run.

The functions are bound at import, before any candidate runs (patching the modules later cannot fool the
trials).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from dice_ray import launch
from dice_ray.verify.trials import inline_launches

__all__ = ["count", "suppressed"]

_fast_launches = launch.launch_count
_inline_launches = inline_launches.launch_count
_suppress_fast = launch.kernels_suppressed
_suppress_inline = inline_launches.kernels_suppressed


def count() -> int:
    """Launches of the candidate's own kernels so far: load_cuda kernels (fast format) plus the
    host launch counters of its load_inline extensions (no CUDA call, so it may be read inside a timed window)."""
    return _fast_launches() + _inline_launches()


@contextlib.contextmanager
def suppressed() -> Iterator[None]:
    """Inside the block every launch of the candidate's kernels, of either format, is counted but not run
    (:func:`dice_ray.launch.kernels_suppressed`, then
    :func:`dice_ray.verify.trials.inline_launches.kernels_suppressed`; cleared in reverse on exit).

    Raises:
        RuntimeError: a load_inline extension could not set or clear its kernel switch.
    """
    with _suppress_fast(), _suppress_inline():
        yield
