"""Verifier throughput on the built-in suite: candidates/s end to end through one Verifier, by kind.

Builds candidates from every built-in task: the honest solution, an incorrect variant (each kernel
skips its first thread), a non-compiling variant and (a few) crashing variants (a null-pointer
store), and verifies them in one sandboxed Verifier on one GPU (compile-only without a GPU). Also
prints the repeatability of one measured speedup (coefficient of variation over 5 repeats).

    python benchmarks/verifier_throughput.py [--crash-every 10] [--repeats 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections import Counter

from dice_ray.config import RewardConfig, VerifyConfig
from dice_ray.tasks.loaders import load_tasks
from dice_ray.verify.verifier import Verifier

KERNEL_OPEN = re.compile(r'(extern\s+"C"\s+__global__[^{]*\{)')


def variants(src: str) -> dict[str, str]:
    """Honest, incorrect, non-compiling and crashing versions of one fast-format solution."""
    return {
        "correct": src,
        "incorrect": KERNEL_OPEN.sub(r"\1 if (blockIdx.x == 0 && threadIdx.x == 0) return;", src),
        "compile_error": KERNEL_OPEN.sub(r"\1 int dice_ray_bench = ;", src, count=1),
        "crash": KERNEL_OPEN.sub(r"\1 *(volatile int*)0 = 1;", src, count=1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--crash-every", type=int, default=10, help="one crashing candidate every N tasks")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()

    tasks = [t for t in load_tasks("builtin").tasks if t.solution_format == "fast"]
    jobs = []
    for i, t in enumerate(tasks):
        v = variants(t.solution_src)
        kinds = ["correct", "incorrect", "compile_error"] + (["crash"] if i % args.crash_every == 0 else [])
        jobs += [(t, kind, v[kind]) for kind in kinds]
    verifier = Verifier(VerifyConfig(), RewardConfig())
    print(f"mode={verifier.mode} tasks={len(tasks)} candidates={len(jobs)}")
    t0 = time.perf_counter()
    got = Counter()
    wrong = []
    per_kind: dict[str, list[float]] = {}
    for n, (task, kind, src) in enumerate(jobs):
        verdict = verifier.verify(task, src, f"{task.task_id}:{kind}")
        got[(kind, verdict.verdict)] += 1
        per_kind.setdefault(kind, []).append(verdict.seconds)
        expected = {"correct": "ok", "incorrect": "incorrect", "compile_error": "compile_error", "crash": "crash"}[kind]
        if verifier.mode == "compile_only" and kind in ("incorrect", "crash"):
            expected = "ok"  # compile-only mode cannot run kernels
        if verdict.verdict != expected:
            wrong.append((task.task_id, kind, verdict.verdict, verdict.reason[:160]))
    total = time.perf_counter() - t0
    rate = len(jobs) / total
    print(f"end to end: {len(jobs)} candidates in {total:.1f} s = {rate:.2f} candidates/s")
    for kind, secs in per_kind.items():
        print(f"  {kind:14s} n={len(secs):3d} median {statistics.median(secs)*1000:8.1f} ms")
    print("verdicts:", dict(got))
    print(f"unexpected verdicts: {len(wrong)}")
    for w in wrong[:20]:
        print("   ", w)

    speedups = []
    if verifier.mode == "gpu":
        task = next(t for t in tasks if t.name.endswith("relu"))
        for _ in range(args.repeats):
            speedups.append(verifier.verify(task, task.solution_src, "repeat").speedup)
        mean = statistics.fmean(speedups)
        cov = statistics.pstdev(speedups) / mean if mean else float("nan")
        print(f"repeatability ({task.task_id}, {args.repeats} repeats): speedups {['%.3f' % s for s in speedups]} CoV {cov:.2%}")
    verifier.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mode": verifier.mode, "candidates": len(jobs), "seconds": total, "candidates_per_s": rate,
                       "verdicts": {f"{k}->{v}": n for (k, v), n in got.items()}, "unexpected": wrong,
                       "repeat_speedups": speedups}, f, indent=1)


if __name__ == "__main__":
    main()
