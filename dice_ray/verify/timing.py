"""Timing in the sandboxed worker: CUDA events, a device-wide sync inside the window, fresh inputs.

One timed call (:func:`time_calls`) is::

    flush L2 (write 2x its size) ; spin the GPU HEADROOM_CYCLES ; start.record()
    out = forward(*inputs_j) ; torch.cuda.synchronize()   # device-wide: side streams cannot hide
    end.record()

on the stream the candidate launches on (``torch.cuda.current_stream()``, which
``dice_ray.launch`` uses).  The spin lets the host's launch overhead (Python, up to ~100 us) overlap
GPU work instead of being timed; the synchronize costs a fixed few microseconds on both sides
(reference and candidate alike): an empty window timed alongside measures it, and the harness
subtracts its median from both sides.
KernelBench's ``timing.py`` records the end event before synchronizing, which lets work on a side
stream or thread escape the window.

Reference and candidate are timed interleaved, call by call, on the same inputs.  Inputs come
from an :class:`InputSchedule`: call ``j`` sees the values ``get_inputs()`` makes under
seed ``base + j``, in pool slot ``j % K``; a slot reused is refilled in place (outside the window)
first.  So every call reads new values, and a candidate that caches by pointer, shape or call count
returns stale outputs; the harness compares the outputs of the timed calls with the reference's on
the same schedule (all of them when memory allows, else a random sample), so caching and
batch-and-skip give wrong answers, not speedups.

:func:`wall_times` is the audit's second clock: host ``perf_counter`` around synchronizes.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch

__all__ = ["HEADROOM_CYCLES", "InputSchedule", "spread_stats", "time_calls", "wall_times"]

# Bound at import, before any candidate runs (patching these later cannot fool the timer).
_Event = torch.cuda.Event
_elapsed = torch.cuda.Event.elapsed_time  # the functions, so patching the class later changes nothing
_record = torch.cuda.Event.record
_zero = torch.Tensor.zero_
_synchronize = torch.cuda.synchronize
_perf = time.perf_counter
_gpu_sleep = getattr(torch.cuda, "_sleep", None)  # spins the GPU for N clock cycles
#: GPU cycles spun before each timed call (~100 us at 2 GHz), after the L2 flush
HEADROOM_CYCLES = 200_000


def spread_stats(times: list[float]) -> tuple[float, float]:
    """(median, (p75 - p25) / median) of ``times`` (any unit; spread dimensionless, 0 for a zero median)."""
    s = sorted(times)
    med = s[len(s) // 2] if len(s) % 2 else 0.5 * (s[len(s) // 2 - 1] + s[len(s) // 2])

    def q(p: float) -> float:
        k = (len(s) - 1) * p
        lo, hi = math.floor(k), math.ceil(k)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)

    return med, (q(0.75) - q(0.25)) / med if med > 0 else 0.0


def input_bytes(inputs: list[Any]) -> int:
    """Bytes of the tensors in one input set."""
    return sum(x.numel() * x.element_size() for x in inputs if isinstance(x, torch.Tensor))


class InputSchedule:
    """The inputs of call ``j``: ``make(base_seed + j)``'s values in pool slot ``j % slots``.

    Args:
        make: ``seed -> list`` of inputs on the device (the reference's ``get_inputs`` under that seed).
        base_seed: seed of call 0.
        calls: calls the schedule serves (``j`` in ``range(calls)``).
        pool_bytes: GPU memory for the pool (bytes); ``slots = clamp(pool_bytes // set_bytes, 2, calls)``.

    A slot is filled when first used and refilled in place (``copy_``: same address, new values)
    whenever it holds another call's values, so any call order is served correctly.
    """

    def __init__(self, make: Callable[[int], list[Any]], base_seed: int, calls: int, pool_bytes: int):
        self.make = make
        self.base_seed = base_seed
        first = make(base_seed)
        per_set = max(input_bytes(first), 1)
        self.slots = int(max(min(2, calls), min(calls, pool_bytes // per_set)))
        self.pool: list[list[Any] | None] = [None] * self.slots
        self.holds: list[int | None] = [None] * self.slots
        self.pool[0], self.holds[0] = first, 0
        self.refills = 0

    def __call__(self, j: int) -> list[Any]:
        """The input set of call ``j`` (filled or refilled now when needed; never inside a timed window)."""
        k = j % self.slots
        if self.holds[k] != j:
            fresh = self.make(self.base_seed + j)
            if self.pool[k] is None:
                self.pool[k] = fresh
            else:
                for dst, src in zip(self.pool[k], fresh):
                    if isinstance(dst, torch.Tensor):
                        dst.copy_(src)
                self.refills += 1
            self.holds[k] = j
        slot = self.pool[k]
        assert slot is not None
        return slot


def time_calls(
    ref_fn: Callable[..., Any],
    cand_fn: Callable[..., Any],
    schedule: InputSchedule,
    calls: int,
    warmup: int,
    flush: torch.Tensor,
    device: int,
    after: Callable[[int, Any, Any], None] | None = None,
    ref_mutates: bool = False,
    baseline: Callable[..., Any] | None = None,
) -> dict[str, list[float]]:
    """CUDA-event times (ms) of reference and candidate, interleaved call by call on the same inputs.

    Call ``j`` runs the reference and the candidate on ``schedule(j)`` (which goes first alternates
    with ``j``), then an empty window, then ``baseline`` when given, each in its own window, so
    clock and thermal drift hit every side alike.

    Args:
        ref_fn, cand_fn: the forwards, called under ``torch.no_grad()``.
        schedule: inputs of call ``j``.
        calls: total calls, the first ``warmup`` untimed.
        flush: a device buffer twice the L2 size, zeroed before each window.
        device: CUDA ordinal (``torch.cuda.synchronize(device)`` waits for every stream on it).
        after: ``after(j, ref_out, cand_out)`` runs after the windows of call ``j`` (output checks,
            launch counts); it may raise.
        ref_mutates: the reference modifies its inputs: it (and ``baseline``) get a copy, made
            outside the window.
        baseline: another reference to time alongside (``torch.compile`` of it).

    Returns:
        ``calls - warmup`` times (ms) a side, in call order, under ``"reference"``, ``"candidate"``,
        ``"empty"`` (windows around no work: the synchronize and event records, a few microseconds,
        which the harness subtracts) and ``"baseline"`` when given.
    """
    fns = {"reference": ref_fn, "candidate": cand_fn, "empty": _nothing}
    if baseline is not None:
        fns["baseline"] = baseline
    starts = {k: [_Event(enable_timing=True) for _ in range(calls)] for k in fns}
    ends = {k: [_Event(enable_timing=True) for _ in range(calls)] for k in fns}
    order = list(fns)
    for j in range(calls):
        args = schedule(j)
        outs: dict[str, Any] = {}
        for side in (order if j % 2 == 0 else [order[1], order[0], *order[2:]]):
            copy = ref_mutates and side in ("reference", "baseline")
            call_args = [x.clone() if isinstance(x, torch.Tensor) else x for x in args] if copy else args
            _zero(flush)
            if _gpu_sleep is not None:
                _gpu_sleep(HEADROOM_CYCLES)
            _record(starts[side][j])
            with torch.no_grad():
                outs[side] = fns[side](*call_args)
            _synchronize(device)
            _record(ends[side][j])
        if after is not None:
            after(j, outs["reference"], outs["candidate"])
        del outs
    _synchronize(device)
    return {k: [_elapsed(starts[k][j], ends[k][j]) for j in range(warmup, calls)] for k in fns}


def _nothing(*args: Any) -> None:
    """The empty window: what the timer itself costs (flush excluded, sync and event records included)."""
    return None


def wall_times(fn: Callable[..., Any], schedule: InputSchedule, calls: int, flush: torch.Tensor, device: int) -> list[float]:
    """Host wall-clock times (ms) of ``calls`` calls, each between two device-wide synchronizes (the audit)."""
    times = []
    for j in range(calls):
        args = schedule(j)
        _zero(flush)
        _synchronize(device)
        t0 = _perf()
        with torch.no_grad():
            fn(*args)
        _synchronize(device)
        times.append((_perf() - t0) * 1e3)
    return times
