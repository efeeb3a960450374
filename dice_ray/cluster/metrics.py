"""Ray custom metrics of a run (``ray.util.metrics``), shown in the Ray dashboard / Prometheus.

One gauge per per-step figure, tagged with the run name. Names and meanings:

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

from ray.util.metrics import Gauge

PHASE_CODE = {"infill": 0, "ramp": 1, "e2e": 2}

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
    """Gauges for one run; :meth:`publish` sets every known key present in a step record."""

    def __init__(self, run_name: str):
        self.tags = {"run": run_name}
        self.gauges = {k: Gauge(f"dice_ray_{k}", description=d, tag_keys=("run",)) for k, d in METRICS.items()}

    def publish(self, record: dict) -> None:
        """Export a step record (keys as in :data:`METRICS`; ``phase`` may be its name)."""
        for key, gauge in self.gauges.items():
            value = record.get(key)
            if key == "phase" and isinstance(value, str):
                value = PHASE_CODE.get(value)
            if isinstance(value, (int, float)) and value == value:
                gauge.set(float(value), tags=self.tags)
