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
``dice_ray_phase``                     0 infill, 1 ramp, 2 end-to-end
``dice_ray_step``                      RL step just finished
``dice_ray_rollout_tokens_per_s``      response tokens sampled a second (all rollout workers)
``dice_ray_learner_step_seconds``      wall time of the learner's optimizer step
``dice_ray_step_seconds``              wall time of the whole RL step
``dice_ray_verifier_queue_depth``      candidates waiting in the verifier pool
``dice_ray_verifier_throughput``       verdicts a second over the step's verification
``dice_ray_verifier_pool_size``        verifier actors serving
``dice_ray_groups_dropped``            groups with equal rewards (no learning signal) this step
=====================================  ==========================================================
"""

from __future__ import annotations

import math

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
    "phase": "0 infill, 1 ramp, 2 end-to-end",
    "step": "RL step just finished",
    "rollout_tokens_per_s": "response tokens sampled a second",
    "learner_step_seconds": "wall time of the learner's optimizer step",
    "step_seconds": "wall time of the whole RL step",
    "verifier_queue_depth": "candidates waiting in the verifier pool",
    "verifier_throughput": "verdicts a second over the step's verification",
    "verifier_pool_size": "verifier actors serving",
    "groups_dropped": "groups with equal rewards this step",
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
