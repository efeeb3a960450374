"""Timing in the sandboxed worker: CUDA events, a device-wide sync inside the window, fresh inputs.

One timed window (:func:`time_calls`) is::

    hold every SM, its blocks first flushing L2 (writing 2x its size) ; start.record()
    for i < n: out_i = forward(*inputs_j+i)                # n in [k, 2k-1] fresh input sets, back to back
    release the hold                                     # the GPU starts the calls, all queued
    stream_end.record()                                  # stream-ordered: no host in the measurement
    torch.cuda.synchronize()                             # device-wide: side streams cannot hide
    end.record()

on the stream the candidate launches on (``torch.cuda.current_stream()``, which ``dice_ray.launch``
uses), with ``k`` chosen per side (:func:`calls_per_window`: each side's window is 1-2x
``timing_window_ms`` of its own GPU time, less for calls under ~2 us (k is capped at 64), so a slow
candidate does not stretch the fast reference's windows, nor the other way round).  The hold
(:meth:`~dice_ray.verify.trials.gpu_spin.FillSpin.hold`, a spin the host releases once it has queued the
window's calls) keeps the host's launch overhead (Python: ~25 us a call for a launcher, more for a
module of many ops) out of the window without a spin sized by guess; it holds every thread slot of
every SM, so work the calls put on another stream cannot run beside it, before the start event.

A window's time is ``start -> stream_end``.  The device-wide synchronize inside the window is the
guard: the reference is the task's PyTorch code, whose work all runs on the launching stream, so
its windows' ``stream_end -> end`` gap is only the synchronize's return and the host's wake-up.  A
window whose gap exceeds the reference windows' median gap by more than twice their IQR (clamped
to 5-10 us, :func:`outlast_limit_ms`) had work on another stream or thread that outlasted the
launching stream: it is timed ``start -> end`` less that median instead, so such work is timed, not
hidden.  Side-stream work that ends within that margin after ``stream_end`` (at most 10 us a
window, 8 % of a 0.125 ms window) goes untimed.  (The empty windows this replaced measured the
host's Python between two records as well, 20-40 us on an H200: the side_stream.py corpus cheat
then got 28.5x by CUDA events against 0.7x by the host clock, with 0.25 ms windows.)  Measured on
an H200 (64 MB relu, windows of 8-15 calls): the per-window spread (IQR) is 0.46 % of the median
ending at ``stream_end`` and 3.9 % ending at ``end``, the host's wake-up jitter (a few
microseconds) divided by the window.
KernelBench's ``timing.py`` records its end event before synchronizing and keeps it whatever
happened after, which lets work on a side stream or thread escape the window.

Right after queuing a window's calls, before releasing the hold, the host asks whether the GPU has
reached the window's start event: if it has, the hold timed out
(:data:`~dice_ray.verify.trials.gpu_spin.HOLD_TIMEOUT_CYCLES`: the host took ~20 ms to queue the calls, or a
forward synchronized and so waited on the hold itself) and the GPU may have waited for the host
inside the window, so that window is left out (:class:`WindowTimes` ``host_bound``).

Reference and candidate are timed interleaved, window by window, on the same inputs.  Inputs come
from an :class:`InputSchedule`: call ``j`` sees the values ``get_inputs()`` makes under
seed ``base + j``, in pool slot ``j % K``; a slot reused is refilled in place (outside the window)
first.  So every call reads new values, and a candidate that caches by pointer, shape or call count
returns stale outputs; the harness compares the outputs of the timed calls with the reference's on
the same schedule (each window's last call and a sample drawn in secret), so caching and
batch-and-skip give wrong answers, not speedups.

:func:`wall_times` is the audit's second clock: host ``perf_counter`` around synchronizes.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from dice_ray.verify.trials import gpu_spin

__all__ = ["MAX_CALLS_PER_WINDOW", "OUTLAST_SLACK_MAX_MS", "OUTLAST_SLACK_MS", "InputSchedule", "WindowTimes", "calls_per_window",
           "outlast_limit_ms", "spread_stats", "time_calls", "wall_times", "window_ms", "window_sizes"]

# Bound at import, before any candidate runs (patching these later cannot fool the timer).
_Event = torch.cuda.Event
_elapsed = torch.cuda.Event.elapsed_time  # the functions, so patching the class later changes nothing
_record = torch.cuda.Event.record
_query = torch.cuda.Event.query
_synchronize = torch.cuda.synchronize
_perf = time.perf_counter
#: most ``k`` of :func:`calls_per_window` (a window then holds k..2k-1 calls, :func:`window_sizes`)
MAX_CALLS_PER_WINDOW = 64
#: least and most slack (ms) above the reference windows' median synchronize-and-wake-up gap before a
#: window's work counts as outlasting its stream (:func:`outlast_limit_ms`)
OUTLAST_SLACK_MS = 0.005
OUTLAST_SLACK_MAX_MS = 0.010


@dataclass
class WindowTimes:
    """What :func:`time_calls` measured.

    Attributes:
        per_call: ms a call of each side (``"reference"``, ``"candidate"``, ``"baseline"`` when timed), one
            value a timed window, in window order: the window's time over its calls.
        gap_ms: the ``stream_end -> end`` gaps (ms) of the reference's timed windows that the host
            did not fall behind on: the synchronize's return and the host's wake-up after work that
            all ran on the launching stream (the baseline of :func:`outlast_limit_ms`).
        outlasted: per side, the timed windows whose work outlasted the launching stream (timed to the
            device-wide synchronize instead of the stream-ordered end event).
        host_bound: per side, the timed windows whose hold timed out before the host had queued their
            calls (the GPU may have waited for the host inside them): left out of ``per_call`` while
            at least half of the side's windows are clean.
        host_s: host seconds of the windows (warm-up included) by phase: ``launch`` (the hold with its L2
            flush and the start event queued, after the input fills finished), ``enqueue`` (the calls
            queued, with ``each_call``), ``wait`` (release, end events and the device-wide synchronize:
            the GPU running the calls); the input fills are the schedule's ``fill_s``, the output checks
            the caller's ``after``.
    """

    per_call: dict[str, list[float]]
    gap_ms: list[float]
    outlasted: dict[str, int] = field(default_factory=dict)
    host_bound: dict[str, int] = field(default_factory=dict)
    host_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("launch", "enqueue", "wait"), 0.0))


def outlast_limit_ms(gap_ms: list[float]) -> float:
    """Longest ``stream_end -> end`` gap (ms) of a window whose work all ran on its stream: the
    reference windows' median gap plus twice their IQR, clamped to ``[OUTLAST_SLACK_MS,
    OUTLAST_SLACK_MAX_MS]``.  Work hidden on another stream can end at most that slack (5-10 us)
    after the stream's end event without being timed."""
    med, rel = spread_stats(gap_ms)
    return med + min(max(OUTLAST_SLACK_MS, 2.0 * rel * med), OUTLAST_SLACK_MAX_MS)


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
    whenever it holds another call's values, so any call order is served correctly.  ``fill_s``
    counts the host seconds spent making and copying inputs (the first set included).
    """

    def __init__(self, make: Callable[[int], list[Any]], base_seed: int, calls: int, pool_bytes: int):
        self.make = make
        self.base_seed = base_seed
        t0 = _perf()
        first = make(base_seed)
        per_set = max(input_bytes(first), 1)
        self.slots = int(max(min(2, calls), min(calls, pool_bytes // per_set)))
        self.pool: list[list[Any] | None] = [None] * self.slots
        self.holds: list[int | None] = [None] * self.slots
        self.pool[0], self.holds[0] = first, 0
        self.refills = 0
        self.fill_s = _perf() - t0

    def __call__(self, j: int) -> list[Any]:
        """The input set of call ``j`` (filled or refilled now when needed; never inside a timed window)."""
        k = j % self.slots
        if self.holds[k] != j:
            t0 = _perf()
            fresh = self.make(self.base_seed + j)
            if self.pool[k] is None:
                self.pool[k] = fresh
            else:
                for dst, src in zip(self.pool[k], fresh):
                    if isinstance(dst, torch.Tensor):
                        dst.copy_(src)
                self.refills += 1
            self.holds[k] = j
            self.fill_s += _perf() - t0
        slot = self.pool[k]
        assert slot is not None
        return slot


def time_calls(
    ref_fn: Callable[..., Any],
    cand_fn: Callable[..., Any],
    schedule: InputSchedule,
    sizes: dict[str, list[int]],
    warmup: int,
    flush: torch.Tensor,
    device: int,
    after: Callable[[int, Any, Any, list[Any]], None] | None = None,
    checked: Container[int] = (),
    ref_mutates: bool = False,
    baseline: Callable[..., Any] | None = None,
    each_call: Callable[[str, int], None] | None = None,
) -> WindowTimes:
    """CUDA-event times (ms a call) of reference and candidate, interleaved window by window on the same inputs.

    Window ``w`` of a side holds ``sizes[side][w]`` calls, each on its own input set, back to back.
    The window set ``w`` starts at call ``j0`` (the sum of the larger side's sizes before it) and
    each side calls ``j0, j0 + 1, ...`` (``schedule(j)``): both read the same input sets, the side
    with the shorter window a prefix of them.  The reference's window, the candidate's (which goes
    first alternates with ``w``) and ``baseline``'s (with the reference's sizes) follow each other,
    so clock and thermal drift hit every side alike.  Several calls a window (:func:`calls_per_window`)
    make the synchronize's few microseconds of host jitter a small share of a tiny kernel's time.

    Args:
        ref_fn, cand_fn: the forwards, called under ``torch.no_grad()``.
        schedule: inputs of call ``j``; needs ``schedule.slots >=`` every window size.
        sizes: ``{"reference": [...], "candidate": [...]}``, calls in each window (>= 1 each, the same
            number of windows; :func:`window_sizes`), the first ``warmup`` windows untimed.
        flush: a contiguous, 16-byte aligned device buffer twice the L2 size, zeroed by the hold before each window.
        device: CUDA ordinal (``torch.cuda.synchronize(device)`` waits for every stream on it).
        after: ``after(j, ref_out, cand_out, inputs)`` for each candidate call ``j`` in ``checked``,
            once the window set ran (output checks); ``ref_out`` is the reference's timed output of
            call ``j``, or, past the end of its window, one computed then (untimed) on the same
            inputs; ``inputs`` the candidate's input set (a pool slot, refilled later).  It may raise.
        checked: the candidate calls ``after`` sees.
        ref_mutates: the reference modifies its inputs: it (and ``baseline``) get copies, made
            outside the window.
        baseline: another reference to time alongside (``torch.compile`` of it).
        each_call: ``each_call(side, j)`` right after each call is enqueued, inside the window:
            host-only checks such as launch counters (no CUDA calls); it may raise.

    Returns:
        :class:`WindowTimes`: ``windows - warmup`` times (ms a call: window time / its size) a side, in
        window order, under ``"reference"``, ``"candidate"`` and ``"baseline"`` when given; a window's
        time ends at its stream-ordered end event, or, when its work outlasted the stream by more than
        :func:`outlast_limit_ms`, at the event after the device-wide synchronize less the reference's
        median gap (see the module docstring); the reference's gaps (ms); per side, the windows
        that outlasted their stream and those the host fell behind on (left out while half are clean).

    Raises:
        ValueError: window sizes < 1 or more than ``schedule.slots``, sides with different window counts, or no
            timed window (``warmup >= windows``).
    """
    ref_sizes, cand_sizes = sizes["reference"], sizes["candidate"]
    every = [*ref_sizes, *cand_sizes]
    if not ref_sizes or len(ref_sizes) != len(cand_sizes) or not 1 <= min(every) <= max(every) <= schedule.slots:
        raise ValueError(f"window sizes {min(every, default=0)}..{max(every, default=0)} over {len(ref_sizes)} and "
                         f"{len(cand_sizes)} windows: need as many windows a side, sizes in [1, schedule.slots={schedule.slots}]")
    windows = len(ref_sizes)
    if not 0 <= warmup < windows:
        raise ValueError(f"warmup={warmup} of {windows} windows: need 0 <= warmup < windows (at least one timed window)")
    fns = {"reference": ref_fn, "candidate": cand_fn}
    side_sizes = {"reference": ref_sizes, "candidate": cand_sizes}
    if baseline is not None:
        fns["baseline"] = baseline
        side_sizes["baseline"] = ref_sizes
    spin = gpu_spin.for_device(device)
    stream = torch.cuda.current_stream(device)  # the launching stream, looked up once (~8 us a lookup)
    starts = {k: [_Event(enable_timing=True) for _ in range(windows)] for k in fns}
    stream_ends = {k: [_Event(enable_timing=True) for _ in range(windows)] for k in fns}
    ends = {k: [_Event(enable_timing=True) for _ in range(windows)] for k in fns}
    order = list(fns)
    behind: dict[str, set[int]] = {k: set() for k in fns}  # windows the host was still enqueuing at their start
    host = WindowTimes({}, []).host_s
    first = 0

    def fresh(a: list[Any]) -> list[Any]:
        return [x.clone() if isinstance(x, torch.Tensor) else x for x in a]

    for w in range(windows):
        span = max(ref_sizes[w], cand_sizes[w])
        calls = range(first, first + span)
        first += span
        args = [schedule(j) for j in calls]
        outs: dict[str, list[Any]] = {}
        for side in (order if w % 2 == 0 else [order[1], order[0], *order[2:]]):
            n = side_sizes[side][w]
            copy = ref_mutates and side in ("reference", "baseline")
            call_args = [fresh(a) for a in args[:n]] if copy else args
            fn = fns[side]
            t0 = _perf()
            token = spin.hold(stream, flush)
            _record(starts[side][w], stream)
            t1 = _perf()
            try:
                with torch.no_grad():
                    outs[side] = []
                    for i in range(n):
                        outs[side].append(fn(*call_args[i]))
                        if each_call is not None:
                            each_call(side, calls[i])
                if _query(starts[side][w]):  # the hold timed out before the host had queued the window
                    behind[side].add(w)
            finally:
                spin.release(token)  # a forward or check that raised: the GPU goes on at once, not at the timeout
            t2 = _perf()
            _record(stream_ends[side][w], stream)
            _synchronize(device)
            _record(ends[side][w], stream)
            t3 = _perf()
            host["launch"] += t1 - t0
            host["enqueue"] += t2 - t1
            host["wait"] += t3 - t2
        if after is not None:
            for i in range(cand_sizes[w]):
                j = calls[i]
                if j not in checked:
                    continue
                if i < ref_sizes[w]:
                    ref_out = outs["reference"][i]
                else:
                    with torch.no_grad():
                        ref_out = ref_fn(*(fresh(args[i]) if ref_mutates else args[i]))
                after(j, ref_out, outs["candidate"][i], args[i])
        del outs
    _synchronize(device)
    timed = range(warmup, windows)
    ref_clean = [w for w in timed if w not in behind["reference"]]
    gaps = [_elapsed(stream_ends["reference"][w], ends["reference"][w]) for w in (ref_clean or timed)]
    limit, overhead = outlast_limit_ms(gaps), spread_stats(gaps)[0]
    out = WindowTimes({}, gaps, host_s=host)
    for k in fns:
        clean = [w for w in timed if w not in behind[k]]
        out.host_bound[k] = len(timed) - len(clean)
        out.per_call[k], out.outlasted[k] = [], 0
        for w in (clean if 2 * len(clean) >= len(timed) else timed):
            ms, outlasted = window_ms(_elapsed(starts[k][w], stream_ends[k][w]), _elapsed(starts[k][w], ends[k][w]),
                                      limit, overhead)
            out.outlasted[k] += outlasted
            out.per_call[k].append(ms / side_sizes[k][w])
    return out


def window_ms(on_stream_ms: float, to_sync_ms: float, limit_ms: float, overhead_ms: float) -> tuple[float, bool]:
    """One window's time (ms) and whether its work outlasted the launching stream.

    Args:
        on_stream_ms: ``start -> stream_end`` (the stream-ordered end event).
        to_sync_ms: ``start -> end`` (the event recorded after the device-wide synchronize).
        limit_ms: :func:`outlast_limit_ms` of the reference's gaps.
        overhead_ms: the reference windows' median ``stream_end -> end`` gap (the synchronize's return and
            the host's wake-up).

    Returns:
        ``(on_stream_ms, False)`` when ``to_sync_ms - on_stream_ms <= limit_ms`` (the device was idle at
        the stream's end); else ``(max(on_stream_ms, to_sync_ms - overhead_ms), True)``: work on another
        stream or thread ran on, and it is timed up to the synchronize.
    """
    if to_sync_ms - on_stream_ms <= limit_ms:
        return on_stream_ms, False
    return max(on_stream_ms, to_sync_ms - overhead_ms), True


def calls_per_window(call_ms: float, window_ms: float, limit: int, cap: int = MAX_CALLS_PER_WINDOW) -> int:
    """Calls a window of one side needs to reach ``window_ms`` of GPU time: ``ceil(window_ms / call_ms)``,
    at least 1, at most ``cap`` and ``limit`` (pool slots, output memory).  ``call_ms``: GPU time of
    one call of that side (ms); ``window_ms`` <= 0 or an unknown ``call_ms`` gives 1.  Each side gets
    its own count, so both windows last about ``window_ms`` whatever the speedup."""
    if window_ms <= 0 or not call_ms > 0:
        return 1
    return int(max(1, min(math.ceil(window_ms / call_ms), cap, limit)))


def window_sizes(k: int, windows: int, rng: random.Random) -> list[int]:
    """``windows`` window sizes drawn uniformly from ``[k, 2k - 1]`` (all 1 when ``k`` is 1).

    The size of a window is secret to the candidate (``rng`` is seeded from ``os.urandom``), so it
    cannot tell which call ends a window: deferring one call's work to a later call leaves a
    window's last output unwritten when it is checked.
    """
    return [k if k == 1 else rng.randint(k, 2 * k - 1) for _ in range(windows)]


def wall_times(fn: Callable[..., Any], schedule: InputSchedule, sizes: list[int], flush: torch.Tensor,
               device: int) -> list[float]:
    """GPU time (ms a call) of ``fn`` by the host clock alone: the audit's second clock.

    Each window is ``flush ; hold ; sizes[w] calls queued ; release ; synchronize``, timed with ``perf_counter``
    from the release to the synchronize's return, next to an empty window (``hold ; release ;
    synchronize``); their difference over ``sizes[w]`` is the calls' GPU time (the host's queuing
    happens before the release, and the release's and synchronize's latency cancels).  A window whose
    hold timed out before the release (its calls took the host ~20 ms to queue, so the GPU ran some of
    them before the release) is timed from the hold instead, the host's queuing included: never less
    than the GPU's time.  No CUDA event times it (one recorded after the hold only flags a timeout), so
    a candidate that fools the events cannot fool this.  Calls use ``schedule``'s
    inputs from call 0 on, like :func:`time_calls`.
    """
    spin = gpu_spin.for_device(device)
    stream = torch.cuda.current_stream(device)
    passed = _Event()  # recorded after the hold: a flag (has the GPU passed it?), never a clock here
    windows: list[tuple[float, float, int]] = []
    first = 0
    for size in sizes:
        args = [schedule(j) for j in range(first, first + size)]
        first += size
        pair = []
        for calls in (args, []):
            spin(0, stream, flush)  # the L2 flush, done before the hold
            _synchronize(device)
            t_hold = _perf()
            token = spin.hold(stream)
            _record(passed, stream)
            try:
                with torch.no_grad():
                    for a in calls:
                        fn(*a)
            finally:
                t0 = _perf()
                if _query(passed):  # the hold timed out: some calls ran before the release
                    t0 = t_hold
                spin.release(token)
            _synchronize(device)
            pair.append((_perf() - t0) * 1e3)
        windows.append((pair[0], pair[1], size))
    empty, _ = spread_stats([e for _, e, _ in windows])
    return [max(t - empty, 0.0) / n for t, _, n in windows]
