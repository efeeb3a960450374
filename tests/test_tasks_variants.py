"""The built-in suite's slower honest variants (``solution_slow.py``, :attr:`Task.solution_variants`, issue 40):
enough tasks have one; each differs from its task's solution in its CUDA code (not only in comments), launches the
same kernels, carries no label (the warm start learns the file: the policy must tell the two apart by their code) and
has its slowdown's mechanism named in ``benchmarks/speedup_variants.py``; each is ``ok`` in the compile-only
verifier (static rules, NVRTC compile, dry run on meta tensors) and (``@pytest.mark.gpu``) ``ok`` and correct on a
GPU. How much slower each is on a GPU is ``benchmarks/speedup_variants.py``'s to measure, not a test's; on CPU, its
task selection, its pairing of each solution with its variant and its exit without a GPU."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from _helpers import HANG_S, BENCHMARKS, load_benchmark
from dice_ray.config import RewardConfig, VerifyConfig
from dice_ray.tasks.scaffold import make_scaffold
from dice_ray.verify.verifier import Verifier
from test_tasks_suite import TASKS, _kernel_calls

bench = load_benchmark("speedup_variants")

VARIANTS = [(task, src) for task in TASKS for src in task.solution_variants]
IDS = [f"{task.task_id}:variant{i}" for task in TASKS for i in range(len(task.solution_variants))]
_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def _code(cuda: str) -> str:
    """CUDA source without comments and whitespace: what the compiler sees, give or take the preprocessor."""
    return re.sub(r"\s+", "", _COMMENT.sub("", cuda))


def _verify_all(mode: str, **cfg) -> list[tuple[str, str, bool | None, str]]:
    """``(candidate id, verdict, correct, reason)`` of every variant, verified in one batch by a Verifier in ``mode``."""
    with Verifier(VerifyConfig(mode=mode, **cfg), RewardConfig(), device=0 if mode == "gpu" else None) as v:
        verdicts = v.verify_many([(task, src, cid) for (task, src), cid in zip(VARIANTS, IDS)])
    return [(cid, r.verdict, r.correct, r.reason[:300]) for cid, r in zip(IDS, verdicts)]


def test_at_least_20_tasks_have_a_slower_variant():
    with_variant = [t.task_id for t in TASKS if t.solution_variants]
    assert len(with_variant) >= 20, with_variant
    assert all(t.solution_format == "fast" for t in TASKS if t.solution_variants)


@pytest.mark.parametrize(("task", "src"), VARIANTS, ids=IDS)
def test_variant_differs_in_code_launches_the_same_kernels_and_says_why(task, src):
    cuda, fast = make_scaffold(src, "fast").middle, make_scaffold(task.solution_src, "fast").middle
    assert _code(cuda) != _code(fast), "the variant's CUDA code is the solution's"
    assert _kernel_calls(ast.parse(src)) == _kernel_calls(ast.parse(task.solution_src))
    assert bench.MECHANISMS.get(task.name), "benchmarks/speedup_variants.py names the mechanism of the slowdown"
    assert "Slow" not in src and "slow" not in cuda, "nothing in the file labels it (the policy learns the file)"


def test_every_variant_is_ok_compile_only():
    """Static rules, compile for sm_90 and a dry run on meta tensors: what a CPU can check of a candidate."""
    verdicts = _verify_all("compile_only")
    bad = [(cid, verdict, reason) for cid, verdict, _, reason in verdicts if verdict != "ok"]
    assert not bad, bad


@pytest.mark.gpu
def test_every_variant_is_ok_and_correct_on_the_gpu():
    """Each variant is ``ok`` on a GPU: correct on every trial (the doubled-shape one too) and timed, like the
    solutions (tests/test_tasks_suite.py): the SFT warm start learns them, so a wrong one is a defect."""
    verdicts = _verify_all("gpu", timing_trials=5)
    bad = [(cid, verdict, correct, reason) for cid, verdict, correct, reason in verdicts if verdict != "ok" or not correct]
    assert not bad, bad


def test_benchmark_pairs_each_tasks_solution_with_its_variant(monkeypatch):
    """benchmarks/speedup_variants.py on CPU: the tasks it selects, and the ratio it computes from each pair's verdicts
    (a stand-in Verifier answers: fast 1.2x, slow 0.4x, except one slow side incorrect)."""
    assert [t.name for t in bench.select_tasks("softmax, relu")] == ["relu", "softmax"]
    assert len(bench.select_tasks(None)) == len({t.task_id for t, _ in VARIANTS})
    with pytest.raises(ValueError, match="no slower variant for \\['nope'\\]"):
        bench.select_tasks("relu,nope")

    class FakeVerifier:
        def __init__(self, *args, **kwargs):
            self.seen = []

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def verify_many(self, items):
            self.seen = items
            return [SimpleNamespace(verdict="incorrect" if cid == "builtin/L1/softmax:slow" else "ok", reason="",
                                    speedup=1.2 if cid.endswith(":fast") else 0.4, candidate_ms=1.0)
                    for _, _, cid in items]

    monkeypatch.setattr(bench, "Verifier", FakeVerifier)
    rows = bench.measure(bench.select_tasks("relu,softmax"), timing_trials=3)
    assert [r["task"] for r in rows] == ["builtin/L1/relu", "builtin/L1/softmax"]
    assert rows[0]["ratio"] == pytest.approx(3.0) and rows[1]["ratio"] is None
    assert rows[1]["slow"]["verdict"] == "incorrect" and rows[1]["fast"]["speedup"] == 1.2


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the no-GPU path")
def test_benchmark_without_a_gpu_says_so_and_exits_0():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "speedup_variants.py"), "--tasks", "relu"],
                          capture_output=True, text=True, env=env, timeout=HANG_S)
    assert proc.returncode == 0 and "no GPU" in proc.stdout, proc.stderr[-2000:]
