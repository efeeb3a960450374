"""benchmarks/gpu_fault_stall.py: which victim iterations a fault's window catches, and the run without a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from _helpers import HANG_S, load_benchmark

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_fault_stall.py"
bench = load_benchmark("gpu_fault_stall")


def test_longest_iteration_counts_every_iteration_that_overlaps_the_window():
    # iterations [0, 1], [1, 1.2] (stalled: 200 ms), [1.2, 1.3], [5, 5.001]
    starts = np.array([0.0, 1.0, 1.2, 5.0])
    ends = np.array([1.0, 1.2, 1.3, 5.001])
    assert bench.longest_iteration_ms(starts, ends, 1.05, 1.1) == pytest.approx(200.0)  # inside one iteration
    assert bench.longest_iteration_ms(starts, ends, 1.25, 4.0) == pytest.approx(100.0)  # its tail only
    assert bench.longest_iteration_ms(starts, ends, 0.5, 1.25) == pytest.approx(1000.0)  # first one overlaps too
    assert bench.longest_iteration_ms(starts, ends, 2.0, 3.0) is None  # the victim ran nothing then


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")
def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    out = tmp_path / "stall.json"
    r = subprocess.run([sys.executable, str(BENCH), "--json", str(out)], capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0 and "skipped (no GPU" in r.stdout, r.stderr[-500:]
    assert json.loads(out.read_text()) == {"skipped": "no GPU"}


def test_bad_counts_fail_in_one_line_naming_them():
    r = subprocess.run([sys.executable, str(BENCH), "--victims", "0"], capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 2 and "--victims must be >= 1, got 0" in r.stderr and "Traceback" not in r.stderr, r.stderr[-500:]
    assert "--contexts" not in r.stderr.splitlines()[-1]  # only the bad flag is named
    r = subprocess.run([sys.executable, str(BENCH), "--victim-mib", "0", "--fault-mib", "-3", "--device", "-2"],
                       capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 2 and ("--victim-mib must be >= 1, got 0; --fault-mib must be >= 1, got -3; "
                                  "--device must be >= 0, got -2") in r.stderr, r.stderr
