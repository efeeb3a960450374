"""benchmarks/verifier_throughput.py --pool on CPU at a tiny size: compile-only verifier pools of 1 and
2 actors on a local Ray cluster give every candidate exactly one verdict of the expected kind; and
the ``--pool`` argument's rules."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _helpers import HANG_S, load_benchmark
from dice_ray.config import VerifyConfig

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "verifier_throughput.py"


bench = load_benchmark("verifier_throughput")


def test_pool_sizes_parse_and_reject_bad_lists():
    assert bench.parse_pool_sizes("4,1,2,2") == [1, 2, 4]
    for bad, rule in (("1,x", "comma-separated integers"), ("0,1", ">= 1"), ("2,4", "must include 1"), ("", ">= 1")):
        with pytest.raises(argparse.ArgumentTypeError, match=rule):
            bench.parse_pool_sizes(bad)


@pytest.mark.parametrize("flags, says", [(["--spare-workers", "-1"], "--spare-workers must be >= 0, got -1\n"),
                                         (["--timing-window-ms", "-1"], "verify.timing_window_ms"),
                                         (["--workers", "65"], "verify.workers"),  # the config's upper bound
                                         (["--crash-every", "-1"], "--crash-every must be >= 0, got -1"),
                                         (["--tasks", "-3"], "error: --tasks must be >= 0, got -3\n"),
                                         (["--workers", "-3", "--copies", "0", "--rounds", "0"],
                                          "--rounds must be >= 1, got 0; --workers must be >= 0, got -3; "
                                          "--copies must be >= 1, got 0\n"),
                                         (["--crash-every", "0", "--crash-cost"], "--crash-cost needs crashing")])
def test_bad_flags_fail_in_one_line_naming_them(flags, says):
    done = subprocess.run([sys.executable, str(BENCH), *flags], capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr, done.stderr[-800:]


def test_flags_set_the_verifier_config():
    ap_args = argparse.Namespace(workers=2, timing_window_ms=None, spare_workers=None, no_preload_kernels=True,
                                 no_landlock=False)
    cfg = bench.verify_config(ap_args)
    assert cfg.workers == 2 and cfg.preload_kernels is False and cfg.spare_workers == VerifyConfig().spare_workers  # the config's default
    assert cfg.landlock is True
    cfg = bench.verify_config(argparse.Namespace(workers=0, timing_window_ms=0.5, spare_workers=1, no_preload_kernels=False,
                                                 no_landlock=True))
    assert cfg.preload_kernels is True and cfg.timing_window_ms == 0.5 and cfg.spare_workers == 1
    assert cfg.landlock is False and cfg.seccomp is True


def test_expected_verdicts_by_mode():
    assert bench.expected_verdict("incorrect", "gpu") == "incorrect"
    assert bench.expected_verdict("crash", "gpu") == "crash"
    assert bench.expected_verdict("incorrect", "compile_only") == "ok"
    assert bench.expected_verdict("compile_error", "compile_only") == "compile_error"
    assert bench.expected_verdict("cheat", "compile_only") == "cheat"


def test_build_jobs_mixes_kinds_and_zero_means_none():
    from dice_ray.tasks.loaders import load_tasks

    tasks = load_tasks("builtin").tasks[:6]
    kinds = [k for _, k, _ in bench.build_jobs(tasks, 4, 3)]
    assert kinds.count("correct") == 6 and kinds.count("crash") == 2 and kinds.count("cheat") == 2
    kinds = [k for _, k, _ in bench.build_jobs(tasks, 0, 0)]
    assert sorted(set(kinds)) == ["compile_error", "correct", "incorrect"] and len(kinds) == 18


@pytest.mark.slow
def test_pool_mode_runs_compile_only_on_cpu(tmp_path):
    out = tmp_path / "pool.json"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local cluster
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--pool", "1,2", "--tasks", "3", "--json", str(out)],
        capture_output=True, text=True, timeout=HANG_S, env=env, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    # 3 tasks: 3 honest, 3 incorrect, 3 non-compiling, 1 crashing (task 0), 1 cheating (task 0)
    assert figures["gpus"] == 0 and figures["mode"] == "compile_only" and figures["candidates"] == 11
    assert sorted(figures["sizes"]) == ["1", "2"] and figures["skipped"] == [] and figures["ok"] is True
    for n, row in figures["sizes"].items():
        assert row["one_verdict_each"] and row["unexpected"] == [] and row["actor_restarts"] == 0, (n, row)
        assert row["verdicts"] == {"correct->ok": 3, "incorrect->ok": 3, "compile_error->compile_error": 3,
                                   "crash->ok": 1, "cheat->cheat": 1}, (n, row)
        assert row["candidates_per_s"] > 0
    assert figures["sizes"]["1"]["ratio"] == 1.0
    assert figures["targets"]["2"]["met"] is None  # compile-only throughput says nothing about the GPU targets
    assert "N=1" in proc.stdout and "N=2" in proc.stdout and "ratio to N=1" in proc.stdout


def test_rounds_get_sources_new_to_the_compile_caches():
    from dice_ray.tasks.loaders import load_tasks

    tasks = [t for t in load_tasks("builtin").tasks if t.solution_format == "fast"][:3]
    first, second = bench.build_jobs(tasks, 4, 3, 0), bench.build_jobs(tasks, 4, 3, 1)
    assert [k for _, k, _ in first] == [k for _, k, _ in second]
    assert [s for _, _, s in first] == [bench.build_jobs(tasks, 4, 3)[i][2] for i in range(len(first))]  # round 0 unchanged
    for (_, kind, a), (_, _, b) in zip(first, second):
        assert a != b and "/* benchmark round 1 */" in b and b.replace(" /* benchmark round 1 */", "", 1) == a, kind


@pytest.mark.slow
def test_single_verifier_rounds_quote_the_median_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--tasks", "2", "--rounds", "3", "--inline", "0", "--crash-cost", "--json", str(out)],
        capture_output=True, text=True, timeout=HANG_S, env=env, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    # 2 tasks a round: 2 honest, 2 incorrect, 2 non-compiling, 1 crashing and 1 cheating (task 0)
    assert figures["mode"] == "compile_only" and figures["candidates"] == 3 * 8 and len(figures["rounds"]) == 3
    assert figures["candidates_per_s"] == sorted(figures["rounds"])[1] and not figures["unexpected"]
    assert "median of 3 rounds" in proc.stdout
    # --crash-cost: one more round without the crashing candidate; compile-only times no fault
    cost = figures["crash_cost"]
    assert cost["crashes_a_round"] == 1 and cost["crash_free_s"] > 0 and cost["unexpected"] == 0, cost
    assert cost["fault_ms"] is None and cost["fault_bound_per_s"] is None and "crash cost:" in proc.stdout


def test_speedup_drift_counts_how_far_speedups_moved():
    drift = bench.speedup_drift([(1.0, 1.0), (1.2, 1.0), (0.5, 1.0), (1.05, 1.0)])
    assert drift == {"pairs": 4, "median_pct": 12.5, "p90_pct": 50.0, "over_10pct": 2}
    assert bench.speedup_drift([]) == {}
