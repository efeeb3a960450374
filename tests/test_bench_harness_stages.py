"""benchmarks/harness_stage_costs.py on CPU: the jobs it times (one correct and one incorrect variant of every
fast-format built-in task, with the kernels their sources name), and its exit without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from _helpers import HANG_S, load_benchmark

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "harness_stage_costs.py"


def test_jobs_are_a_correct_and_an_incorrect_variant_of_each_fast_task():
    from dice_ray.tasks.loaders import load_tasks

    fast = [t for t in load_tasks("builtin").tasks if t.solution_format == "fast"]
    work = load_benchmark("harness_stage_costs").jobs()
    assert [k for k, _ in work] == ["correct", "incorrect"] * len(fast)
    for (kind, job), task in zip(work, [t for t in fast for _ in range(2)]):
        assert job["reference_src"] == task.reference_src
        assert (job["candidate_src"] == task.solution_src) == (kind == "correct")
        assert job["kernel_refs"] and all(job["kernel_refs"].values()), task.task_id


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the no-GPU path")
def test_without_a_gpu_it_says_so_and_exits_0():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(BENCH)], capture_output=True, text=True, env=env, timeout=HANG_S)
    assert proc.returncode == 0 and "no GPU" in proc.stdout, proc.stderr[-2000:]
