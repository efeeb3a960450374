"""The run's custom metrics reach Ray's Prometheus export (what the dashboard and Grafana read)."""

import time
import urllib.request

import pytest
import ray

from dice_ray.cluster.metrics import METRICS, RunMetrics

pytestmark = pytest.mark.slow


def test_step_record_is_exported_at_the_metrics_port():
    # Ray exports the recorded values every metrics_report_interval_ms (10 s by default): once a second here
    ctx = ray.init(address="local", num_cpus=1, include_dashboard=False, namespace="dice-ray-test-metrics", log_to_driver=False,
                   _system_config={"metrics_report_interval_ms": 1000})
    try:
        port = ray._private.worker.global_worker.node.metrics_export_port
        m = RunMetrics("metrics-test")
        record = {"reward_mean": 0.625, "compile_rate": 0.5, "phase": "ramp", "correct_rate": None}
        text = ""
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            m.publish(record)
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            if "dice_ray_reward_mean" in text and "dice_ray_phase" in text:
                break
            time.sleep(0.5)
        lines = [ln for ln in text.splitlines() if ln.startswith("ray_dice_ray_") or ln.startswith("dice_ray_")]
        by_name = {ln.split("{")[0].removeprefix("ray_"): float(ln.rsplit(" ", 1)[1]) for ln in lines}
        assert by_name.get("dice_ray_reward_mean") == 0.625, lines
        assert by_name.get("dice_ray_phase") == 1.0  # ramp
        assert "dice_ray_correct_rate" not in by_name  # None is not exported as a number
        assert set(by_name) <= {f"dice_ray_{k}" for k in METRICS}
    finally:
        ray.shutdown()
        del ctx
