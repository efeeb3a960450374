"""Fast solution against slow variant: the GPU verifier's speedup of each built-in task's two honest solutions.

For every built-in task with a slower variant (``solution_slow.py``, :attr:`Task.solution_variants`), verifies its
``solution.py`` and its variant side by side in one batch through one GPU Verifier, and prints each one's measured
speedup over the PyTorch reference (the verdict's ``speedup``, the figure the reward's speedup term reads), their
ratio (fast speedup / slow speedup) and the median ratio. Issue 40 asks every ratio to be at least 1.5 (``--target``)
on an H100/H200, so that RL's speedup term can move a policy warm-started on both towards the faster one.

    python benchmarks/speedup_variants.py [--tasks relu,softmax,...] [--timing-trials 20] [--target 1.5] [--json OUT]

Exits 1 when a ratio is under ``--target`` or a candidate is not ``ok``; without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from dice_ray.config import RewardConfig, VerifyConfig
from dice_ray.tasks.loaders import load_tasks
from dice_ray.tasks.task import Task
from dice_ray.verify.verifier import Verifier


#: Why each variant is slower (the mechanism a kernel engineer would name), by task name; printed beside its ratio.
MECHANISMS = {
    "relu": "each thread walks 64 contiguous elements, so a warp's accesses are 256 B apart (uncoalesced).",
    "gelu_tanh": "each thread walks 64 contiguous elements, so a warp's accesses are 256 B apart (uncoalesced).",
    "sigmoid": "each thread walks 64 contiguous elements, so a warp's accesses are 256 B apart (uncoalesced).",
    "tanh": "each thread walks 64 contiguous elements, so a warp's accesses are 256 B apart (uncoalesced).",
    "leaky_relu": "each thread walks 64 contiguous elements, so a warp's accesses are 256 B apart (uncoalesced).",
    "elu": "each thread walks 64 contiguous elements, so a warp's accesses are 256 B apart (uncoalesced).",
    "silu": "each thread walks 64 contiguous elements, so a warp's accesses are 256 B apart (uncoalesced).",
    "square": "each thread walks 64 contiguous elements, so a warp's accesses are 256 B apart (uncoalesced).",
    "abs": "each thread walks 64 contiguous elements, so a warp's accesses are 256 B apart (uncoalesced).",
    "add": "each thread walks 64 contiguous elements, so a warp's accesses are 256 B apart (uncoalesced).",
    "mul": "each thread walks 64 contiguous elements, so a warp's accesses are 256 B apart (uncoalesced).",
    "scale_bias": "each thread walks 64 contiguous elements, so a warp's accesses are 256 B apart (uncoalesced).",
    "exp": "each thread walks 64 contiguous elements, so a warp's accesses are 256 B apart (uncoalesced).",
    "log": "each thread walks 64 contiguous elements, so a warp's accesses are 256 B apart (uncoalesced).",
    "residual_add_relu": "each thread walks 64 contiguous elements, so a warp's accesses are 256 B apart (uncoalesced).",
    "mul_add_relu": "each thread walks 64 contiguous elements, so a warp's accesses are 256 B apart (uncoalesced).",
    "gelu_erf": 'a fixed grid of 32 blocks: 32 of 132 SMs busy, too few loads in flight to hide DRAM latency.',
    "softplus": 'a fixed grid of 32 blocks: 32 of 132 SMs busy, too few loads in flight to hide DRAM latency.',
    "hardswish": 'a fixed grid of 32 blocks: 32 of 132 SMs busy, too few loads in flight to hide DRAM latency.',
    "hardtanh": 'a fixed grid of 32 blocks: 32 of 132 SMs busy, too few loads in flight to hide DRAM latency.',
    "reciprocal": 'a fixed grid of 32 blocks: 32 of 132 SMs busy, too few loads in flight to hide DRAM latency.',
    "hardsigmoid": 'a fixed grid of 32 blocks: 32 of 132 SMs busy, too few loads in flight to hide DRAM latency.',
    "swish_scale": 'a fixed grid of 32 blocks: 32 of 132 SMs busy, too few loads in flight to hide DRAM latency.',
    "bias_add_tanh": 'a fixed grid of 32 blocks: 32 of 132 SMs busy, too few loads in flight to hide DRAM latency.',
    "mean_dim": "one thread per row, so a warp's loads are 4*cols bytes apart (uncoalesced) and 8192 rows fill 32 blocks.",
    "l2norm": "one thread per row, so a warp's loads are 4*cols bytes apart (uncoalesced) and 8192 rows fill 32 blocks.",
    "rmsnorm": "one thread per row, so a warp's loads are 4*cols bytes apart (uncoalesced) and 8192 rows fill 32 blocks.",
    "softmax": "one thread per row, so a warp's loads are 4*cols bytes apart (uncoalesced) and 4096 rows fill 16 blocks.",
    "matmul": "no shared-memory tiles, and threadIdx.x walks rows, so a warp's loads of A are 4*K bytes apart (uncoalesced).",
    "matmul_rect": "no shared-memory tiles, and threadIdx.x walks rows, so a warp's loads of A are 4*K bytes apart (uncoalesced).",
    "matvec": "one thread per row, so a warp's loads are 4*K bytes apart (uncoalesced) and 4096 rows fill 16 blocks.",
    "transpose": "no shared-memory tile: reads are coalesced, but a warp's 32 stores land 4*rows bytes apart (uncoalesced).",
}


def select_tasks(names: str | None) -> list[Task]:
    """The built-in tasks with a slower variant, all or those named in ``names`` (comma-separated task names,
    e.g. ``"relu,softmax"``), in suite order.

    Raises:
        ValueError: a name is not that of a built-in task with a variant (the message lists those).
    """
    tasks = [t for t in load_tasks("builtin").tasks if t.solution_variants]
    if not names:
        return tasks
    wanted = {n.strip() for n in names.split(",") if n.strip()}
    unknown = sorted(wanted - {t.name for t in tasks})
    if unknown:
        raise ValueError(f"no slower variant for {unknown}; tasks with one: {', '.join(t.name for t in tasks)}")
    return [t for t in tasks if t.name in wanted]


def measure(tasks: list[Task], timing_trials: int) -> list[dict]:
    """Verify each task's solution and its first variant on GPU 0, interleaved in one batch.

    Returns:
        One row a task: ``{"task", "fast": {...}, "slow": {...}, "ratio"}``, each side ``{"verdict", "speedup",
        "ms", "reason"}`` (``ms``: the candidate's median call time); ``ratio`` is fast speedup / slow speedup, None
        unless both are ``ok``.
    """
    items = [(t, src, f"{t.task_id}:{side}") for t in tasks for side, src in (("fast", t.solution_src),
                                                                              ("slow", t.solution_variants[0]))]
    with Verifier(VerifyConfig(mode="gpu", timing_trials=timing_trials), RewardConfig(), device=0) as v:
        verdicts = v.verify_many(items)
    rows = []
    for i, task in enumerate(tasks):
        fast, slow = ({"verdict": r.verdict, "speedup": r.speedup, "ms": r.candidate_ms, "reason": r.reason[:200]}
                      for r in verdicts[2 * i: 2 * i + 2])
        both = all(side["verdict"] == "ok" and side["speedup"] for side in (fast, slow))
        rows.append({"task": task.task_id, "fast": fast, "slow": slow,
                     "ratio": fast["speedup"] / slow["speedup"] if both else None})
    return rows


def _cell(side: dict) -> str:
    """``speedup (ms)`` of one side, or its verdict when it has no speedup."""
    if side["verdict"] != "ok" or side["speedup"] is None:
        return f"{side['verdict']:>18s}"
    return f"{side['speedup']:8.3f} ({side['ms']:7.3f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--tasks", default=None, help="comma-separated task names (default: every task with a variant)")
    ap.add_argument("--timing-trials", type=int, default=VerifyConfig().timing_trials,
                    help="timed windows of each of reference and candidate (verify.timing_trials)")
    ap.add_argument("--target", type=float, default=1.5, help="least ratio fast speedup / slow speedup (issue 40)")
    ap.add_argument("--json", default=None, metavar="OUT", help="write the figures here")
    args = ap.parse_args()
    if args.timing_trials < 1:
        ap.error(f"--timing-trials must be >= 1, got {args.timing_trials}")
    try:
        tasks = select_tasks(args.tasks)
    except ValueError as e:
        ap.error(str(e))
    import torch

    if not torch.cuda.is_available():
        print("speedup_variants: skipped (no GPU: speedups are measured on a GPU only; nothing measured)")
        if args.json:
            Path(args.json).write_text(json.dumps({"skipped": "no GPU"}))
        return
    device = torch.cuda.get_device_name(0)
    rows = measure(tasks, args.timing_trials)
    print(f"{device}: {len(rows)} tasks, speedup over the PyTorch reference (candidate ms a call)")
    print(f"{'task':36s} {'fast solution':>18s} {'slow variant':>18s} {'ratio':>7s}")
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}" + (" <" if r["ratio"] < args.target else "")
        print(f"{r['task']:36s} {_cell(r['fast'])} {_cell(r['slow'])} {ratio:>7s}  {MECHANISMS.get(r['task'].rsplit('/', 1)[-1], '')}")
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    short = [r["task"] for r in rows if r["ratio"] is None or r["ratio"] < args.target]
    median = statistics.median(ratios) if ratios else None
    print(f"median ratio {median:.2f} over {len(ratios)} tasks" if ratios else "no task has both sides ok")
    print(f"under the target {args.target} or not ok: {', '.join(short) if short else 'none'}")
    for r in rows:
        for side in ("fast", "slow"):
            if r[side]["verdict"] != "ok":
                print(f"  {r['task']} {side}: {r[side]['verdict']}: {r[side]['reason']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "target": args.target, "timing_trials": args.timing_trials,
                                               "median_ratio": median, "short": short, "tasks": rows}, indent=1))
    raise SystemExit(1 if short else 0)


if __name__ == "__main__":
    main()
