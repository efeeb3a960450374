"""Ray custom metrics of a run (``ray.util.metrics``), shown in the Ray dashboard / Prometheus / Grafana.

One gauge per per-step figure, set by the driver after each RL step from the same record it appends
to ``metrics.jsonl`` (the key is the name without ``dice_ray_``). Each gauge carries the tag ``run``
(the run directory's name). Ray's Prometheus export prefixes application metrics with ``ray_``, so
the Prometheus name is ``ray_`` + the name below (``ray_dice_ray_reward_mean``), with Ray's own
labels added (``SessionName``, ``NodeAddress``, ``WorkerId``, ...). ``dashboards/dice_ray_grafana.json``
plots them all (``tests/test_report.py`` keeps this table, :data:`METRICS` and that dashboard in step).
A figure that was not measured in a step (``None``, e.g. ``correct_rate`` without GPU verifiers)
is not set, so its series keeps its last value. Names and meanings:

=====================================  ==========================================================
``dice_ray_reward_mean``               mean reward of the step's rollouts
``dice_ray_reward_std``                std of those rewards
``dice_ray_compile_rate``              share of candidates that compiled
``dice_ray_correct_rate``              share that matched the reference (GPU verifiers only)
``dice_ray_cheat_rate``                share given a ``cheat`` verdict
``dice_ray_speedup_geomean``           geometric mean speedup over correct candidates
``dice_ray_infill_fraction``           share of the step's prompts that were infilling
``dice_ray_infill_target``             the curriculum's infill fraction for the step (before rounding)
``dice_ray_gate_figure``               the figure behind the newest curriculum decision (e.g. the gate's compile rate)
``dice_ray_phase``                     0 infill, 1 ramp, 2 end-to-end
``dice_ray_step``                      RL step just finished
``dice_ray_rollout_tokens_per_s``      response tokens a second of the step's rollout in flight
``dice_ray_learner_step_seconds``      wall time of the learner's optimizer step
``dice_ray_step_seconds``              wall time of the whole RL step
``dice_ray_verifier_queue_depth``      candidates waiting in the verifier pool
``dice_ray_verifier_throughput``       verdicts a second over the step's verification
``dice_ray_verifier_pool_size``        verifier actors serving
``dice_ray_groups_dropped``            groups with equal rewards (no learning signal) this step
``dice_ray_rollout_seconds``           the step's own rollout: prompts drawn to samples back
``dice_ray_verify_seconds``            the step's own verification: submitted to verdicts back
``dice_ray_learn_seconds``             the step's learner call: submitted to result back
``dice_ray_sync_seconds``              the weight sync after the step's learner call (queued push: queuing it)
``dice_ray_idle_seconds``              step wall time with no stage in flight (driver, checkpoint)
``dice_ray_rollout_busy_share``        share of step wall time with a rollout call in flight
``dice_ray_verify_busy_share``         share of step wall time with a verification in flight
``dice_ray_learner_busy_share``        share of step wall time with a learner step in flight
``dice_ray_gpu_busy_share_mean``       mean over the driver node's GPUs of NVML busy share
``dice_ray_gpu_busy_share_min``        the least busy GPU's NVML busy share
``dice_ray_staleness_max``             most learner steps a sample's weights lagged the step
=====================================  ==========================================================

Stage timings (issue 6). :class:`StageTimeline` keeps, on the driver's clock (``time.perf_counter``),
the interval during which each stage call was *in flight*: from its submission to the moment its
result was ready (a done-callback on the call's ObjectRefs sets the end, so a driver busy elsewhere
does not stretch it). A rollout interval starts when the step's prompts are drawn. The ``*_seconds``
of a step are the durations of that step's own calls (with ``rl.max_staleness > 0`` its rollout and
verification may have run during earlier steps); the ``*_busy_share`` figures and ``idle_seconds``
are measured over the step's wall-clock window, whatever step the work in flight belonged to, so in
the asynchronous pipeline the shares may add up to more than 1. This is how busy each stage's
*actors* were as the driver sees them: a call queued behind another on the same actor counts as
busy (and ``rollout_tokens_per_s`` counts a rollout launched ahead while it waits behind the one
before it). In metrics.jsonl only: ``rollout_learn_overlap_seconds`` (a rollout and a learner step
both in flight), ``checkpoint_seconds``, ``staleness_mean`` and ``timeline`` (each stage's intervals
in seconds from the step's start).

GPU busy share: :class:`GpuBusySampler` reads NVML's ``utilization.gpu`` (the share of the last
sample period, 1/6 s to 1 s by product, during which a kernel ran) of every GPU of the *driver's*
node every 0.2 s in a thread; a GPU's busy share over a step is the mean of its samples taken in
the step's window. ``gpu_busy_share`` (metrics.jsonl) maps NVML device index to share; on a
machine without GPUs or NVML the three GPU figures are None (and not exported).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ray.util.metrics import Gauge

PHASE_CODE = {"infill": 0, "ramp": 1, "e2e": 2}
NAME_PREFIX = "dice_ray_"  # what RunMetrics registers: NAME_PREFIX + key
PROMETHEUS_PREFIX = "ray_"  # what Ray's Prometheus export adds in front of every application metric
RUN_TAG = "run"

METRICS = {
    "reward_mean": "mean reward of the step's rollouts",
    "reward_std": "std of the step's rewards",
    "compile_rate": "share of candidates that compiled",
    "correct_rate": "share of candidates that matched the reference (GPU verifiers only)",
    "cheat_rate": "share of candidates given a cheat verdict",
    "speedup_geomean": "geometric mean speedup over correct candidates",
    "infill_fraction": "share of the step's prompts that were infilling",
    "infill_target": "the curriculum's infill fraction for the step (before rounding)",
    "gate_figure": "the figure behind the newest curriculum decision (e.g. the gate's compile rate)",
    "phase": "0 infill, 1 ramp, 2 end-to-end",
    "step": "RL step just finished",
    "rollout_tokens_per_s": "response tokens sampled a second",
    "learner_step_seconds": "wall time of the learner's optimizer step",
    "step_seconds": "wall time of the whole RL step",
    "verifier_queue_depth": "candidates waiting in the verifier pool",
    "verifier_throughput": "verdicts a second over the step's verification",
    "verifier_pool_size": "verifier actors serving",
    "groups_dropped": "groups with equal rewards this step",
    "rollout_seconds": "the step's own rollout, prompts drawn to samples back (s)",
    "verify_seconds": "the step's own verification, submitted to verdicts back (s)",
    "learn_seconds": "the step's learner call, submitted to result back (s)",
    "sync_seconds": "the weight sync after the step's learner call (s); a queued push (async, object store): queuing it",
    "idle_seconds": "step wall time with no stage in flight (s)",
    "rollout_busy_share": "share of step wall time with a rollout call in flight",
    "verify_busy_share": "share of step wall time with a verification in flight",
    "learner_busy_share": "share of step wall time with a learner step in flight",
    "gpu_busy_share_mean": "mean over the driver node's GPUs of the NVML busy share in the step",
    "gpu_busy_share_min": "the least busy GPU's NVML busy share in the step",
    "staleness_max": "most learner steps a sample's weights lagged the step",
}


class RunMetrics:
    """Gauges for one run (one :class:`ray.util.metrics.Gauge` a key of :data:`METRICS`, tag ``run``).

    :meth:`publish` sets every known key present in a step record. Creating it needs no Ray
    connection; values reach the node's metrics export port once Ray is initialised.

    Args:
        run_name: the value of the ``run`` tag (the trainer passes the run directory's name).
    """

    def __init__(self, run_name: str):
        self.tags = {RUN_TAG: run_name}
        self.gauges = {k: Gauge(NAME_PREFIX + k, description=d, tag_keys=(RUN_TAG,)) for k, d in METRICS.items()}

    def publish(self, record: dict) -> None:
        """Export a step record (keys as in :data:`METRICS`; ``phase`` may be its name)."""
        for key, gauge in self.gauges.items():
            value = record.get(key)
            if key == "phase" and isinstance(value, str):
                value = PHASE_CODE.get(value)
            if isinstance(value, (int, float)) and not math.isnan(value):
                gauge.set(float(value), tags=self.tags)


# ---- stage timings and busy shares (issue 6) ------------------------------------------------------------
STAGES = ("rollout", "verify", "learn", "sync")
BUSY_SHARE_KEYS = {"rollout": "rollout_busy_share", "verify": "verify_busy_share", "learn": "learner_busy_share"}


@dataclass
class Interval:
    """One stage call in flight on the driver's clock (``time.perf_counter``, seconds).

    Attributes:
        stage: one of :data:`STAGES`.
        start: when it was submitted (a rollout: when its prompts were drawn).
        end: when its result was ready; None while still in flight.
    """

    stage: str
    start: float
    end: float | None = None


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``[start, end]`` intervals as sorted disjoint intervals (empty ones dropped)."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The intersection of two unions of intervals (each as :func:`merge` returns it)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def total(intervals: list[tuple[float, float]]) -> float:
    """Summed length (seconds) of disjoint intervals."""
    return sum(b - a for a, b in intervals)


class StageTimeline:
    """When each pipeline stage (:data:`STAGES`) had a call in flight, and per-step figures from that.

    The trainer adds an :class:`Interval` when it submits a call and sets its ``end`` when the result
    is ready (possibly from a Ray callback thread: a float assignment). :meth:`window` turns the
    intervals overlapping a step's wall-clock window into the step's busy shares, idle time and
    rollout / learner overlap; intervals that ended before a window are dropped then.

    Raises:
        ValueError: :meth:`add` with a stage not in :data:`STAGES`, or :meth:`window` with ``t1 <= t0``.
    """

    def __init__(self):
        self._intervals: list[Interval] = []
        self._lock = threading.Lock()

    def add(self, stage: str, start: float, end: float | None = None) -> Interval:
        """Record a call of ``stage`` submitted at ``start`` (``end``: when known already)."""
        if stage not in STAGES:
            raise ValueError(f"stage {stage!r}: must be one of {STAGES}")
        iv = Interval(stage, start, end)
        with self._lock:
            self._intervals.append(iv)
        return iv

    def window(self, t0: float, t1: float) -> dict:
        """The figures of the window ``[t0, t1]`` (a step: perf_counter seconds).

        Returns:
            ``idle_seconds`` (no stage in flight), ``rollout_busy_share`` / ``verify_busy_share`` /
            ``learner_busy_share`` (share of the window in which that stage had a call in flight, in
            [0, 1]), ``rollout_learn_overlap_seconds`` (a rollout and a learner step both in flight) and
            ``timeline``: ``{stage: [[start, end], ...]}``, each stage's merged intervals clipped to the
            window, in seconds from ``t0`` (rounded to 0.1 ms). Calls still in flight count up to ``t1``.
        """
        if t1 <= t0:
            raise ValueError(f"window [{t0}, {t1}]: end must be after start")
        with self._lock:
            ivs = list(self._intervals)
            self._intervals = [iv for iv in ivs if iv.end is None or iv.end > t1]  # later windows need only these
        clipped: dict[str, list[tuple[float, float]]] = {}
        for stage in STAGES:
            clipped[stage] = merge([
                (max(iv.start, t0), min(t1 if iv.end is None else iv.end, t1)) for iv in ivs if iv.stage == stage
            ])
        length = t1 - t0
        busy = merge([iv for stage in STAGES for iv in clipped[stage]])
        out = {key: total(clipped[stage]) / length for stage, key in BUSY_SHARE_KEYS.items()}
        out["idle_seconds"] = length - total(busy)
        out["rollout_learn_overlap_seconds"] = total(intersect(clipped["rollout"], clipped["learn"]))
        out["timeline"] = {
            stage: [[round(a - t0, 4), round(b - t0, 4)] for a, b in clipped[stage]] for stage in STAGES
        }
        return out


def nvml_reader() -> Callable[[], list[float]] | None:
    """A function returning each GPU's NVML ``utilization.gpu`` / 100 on this node, or None when NVML
    (``nvidia-ml-py``) cannot start or sees no GPU. NVML counts every GPU of the node, whatever
    ``CUDA_VISIBLE_DEVICES`` says."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:  # noqa: BLE001 - no driver, no library, no device: no GPU figures
        return None
    if not handles:
        return None
    return lambda: [pynvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0 for h in handles]


class GpuBusySampler:
    """Each GPU's busy share over a window, from utilisation samples taken in a daemon thread.

    Args:
        read: returns one utilisation in [0, 1] a GPU (default :func:`nvml_reader`'s); None, or a
            default with no NVML, makes :meth:`window` return None.
        interval_s: seconds between samples (> 0).

    Raises:
        ValueError: ``interval_s <= 0``.
    """

    def __init__(self, read: Callable[[], list[float]] | None = None, interval_s: float = 0.2):
        if interval_s <= 0:
            raise ValueError(f"interval_s={interval_s}: must be > 0")
        self.read = read if read is not None else nvml_reader()
        self.interval_s = interval_s
        self._samples: deque[tuple[float, list[float]]] = deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> GpuBusySampler:
        """Start sampling (no-op without a reader); returns self."""
        if self.read is not None and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="gpu-busy-sampler", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                sample = (time.perf_counter(), self.read())
            except Exception:  # noqa: BLE001 - a failed read loses one sample, not the run
                sample = None
            if sample is not None:
                with self._lock:
                    self._samples.append(sample)
            self._stop.wait(self.interval_s)

    def window(self, t0: float, t1: float) -> dict[str, float] | None:
        """Mean utilisation of each GPU over the samples taken in ``[t0, t1]`` (perf_counter seconds),
        keyed by device index as a string; drops older samples. None without a reader or samples."""
        with self._lock:
            while self._samples and self._samples[0][0] < t0:
                self._samples.popleft()
            inside = [u for t, u in self._samples if t <= t1]
        if self.read is None or not inside:
            return None
        n = min(len(u) for u in inside)
        return {str(i): sum(u[i] for u in inside) / len(inside) for i in range(n)}

    def stop(self) -> None:
        """Stop the sampling thread (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s + 1)
            self._thread = None
