"""``dice-ray curate``: keep the tasks whose reference solution is correct and fast enough.

The recipe of CuKe-style curation (a kernel dataset filtered by measured speedup): verify each
task's own solution against its reference on a GPU verifier (same pipeline as training, same
anti-cheat rules) and keep those that are ``ok``, correct and at least ``min_speedup`` times
faster than PyTorch eager.  Each kept task is one JSON line: ``task_id``, ``name``, ``level``,
``reference``, ``solution``, ``solution_format``, ``speedup``, ``ref_ms``, ``candidate_ms``,
``hardware``, ``mode``, ``min_speedup`` and ``verifier_config`` (the ``verify`` section used), so
the file says how it was made and can be rebuilt with the same config.  Every solution not kept
gets a line in ``<out>.rejected.jsonl`` (``task_id``, ``verdict``, ``rule``, ``reason``,
``speedup``): why it was left out, in the verifier's words.

Speedups need a GPU.  Without one, :func:`curate` raises :class:`NoGpuVerifier` (the CLI exits 2)
unless ``allow_compile_only`` is set: then every task whose solution compiles and passes the static
and dry-run checks is written with ``speedup: null`` and ``mode: "compile_only"`` (a
compile-checked set, not a speed-filtered one).
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dice_ray.config import DiceConfig
from dice_ray.eval.report import hardware_name
from dice_ray.eval.run import load_eval_tasks, open_verifier, ray_gpus


class NoGpuVerifier(RuntimeError):
    """Curation by speedup was asked for, but no GPU verifier is available."""


def gpu_verifier_available(cfg: DiceConfig) -> bool:
    """True when :func:`~dice_ray.eval.run.open_verifier` would measure on a GPU (Ray or local)."""
    if cfg.verify.mode == "compile_only":
        return False
    if ray_gpus(cfg):
        return True
    import torch

    return torch.cuda.is_available()


def curate(
    tasks_spec: str,
    cfg: DiceConfig,
    min_speedup: float,
    out: str | Path,
    allow_compile_only: bool = False,
    log: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    """Verify every task's solution and write the accepted ones to ``out`` (JSON lines).

    Args:
        tasks_spec: see :func:`dice_ray.tasks.loaders.load_tasks`.
        cfg: its ``verify``, ``reward``, ``cluster`` and ``tasks`` sections apply.
        min_speedup: keep solutions with ``speedup >= min_speedup`` (x PyTorch eager, > 0).
        out: the JSONL file to write (parent folders are created).
        allow_compile_only: without a GPU, write compile-checked tasks (speedup null) instead of failing.

    Returns:
        Summary: ``tasks``, ``with_solution``, ``correct`` (ok verdicts, measured correct on a GPU),
        ``accepted``, ``verdicts`` (count by kind), ``speedup_median`` and ``speedup_geomean`` over
        the correct solutions (x eager; None without any), ``hardware``, ``verifier``, ``mode``,
        ``out`` and ``rejected_out`` (the sidecar of left-out solutions).
    Raises:
        ValueError: ``min_speedup`` is not a finite number > 0.
        NoGpuVerifier: no GPU verifier and not ``allow_compile_only``.
        EvalInputError: ``out`` is a folder or its folder cannot be created, no task accepted, or no
            task has a solution.
    """
    from dice_ray.eval.run import EvalInputError

    if not (min_speedup > 0 and math.isfinite(min_speedup)):
        raise ValueError(f"--min-speedup must be a finite number > 0, got {min_speedup}")
    path = Path(out)
    try:  # before any work: the verdicts must not be lost for want of a place to write them
        if path.is_dir():
            raise IsADirectoryError(21, "is a folder, want a file")
        if any(d.exists() and not d.is_dir() for d in path.parents):
            raise NotADirectoryError(20, f"{next(d for d in path.parents if d.exists() and not d.is_dir())} is not a folder")
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EvalInputError(f"--out {out}: cannot write there ({e.strerror or e})") from None
    gpu = gpu_verifier_available(cfg)
    if not gpu and not allow_compile_only:
        raise NoGpuVerifier("curate: speedups need a GPU verifier (none found: no CUDA device, no Ray GPUs, or "
                            "verify.mode=compile_only); pass --allow-compile-only to write compile-checked tasks "
                            "without speedups")
    tasks = load_eval_tasks(tasks_spec, cfg, log)
    solved = [t for t in tasks if t.solution_src is not None]
    if not solved:
        raise EvalInputError(f"tasks {tasks_spec!r}: no task has a solution to curate")
    log(f"verifying the solutions of {len(solved)} of {len(tasks)} task(s)")
    with open_verifier(cfg) as (verify, verifier_desc):
        verdicts = verify([(f"{t.task_id}#solution", t, t.solution_src) for t in solved])
    hardware = hardware_name(verdicts)
    rows, rejected, speedups = [], [], []
    for task, v in zip(solved, verdicts):
        if v.verdict == "ok" and v.correct is True and v.speedup is not None:
            speedups.append(v.speedup)
        why = None
        if v.verdict != "ok":
            why = v.verdict
        elif v.mode == "gpu" and not (v.correct is True and v.speedup is not None and v.speedup >= min_speedup):
            why = "below-min-speedup"
        if why is not None:
            rejected.append({"task_id": task.task_id, "verdict": v.verdict, "why": why, "rule": v.rule,
                             "reason": (v.reason or "")[:2000], "speedup": v.speedup})
            continue
        rows.append({
            "task_id": task.task_id, "name": task.name, "level": task.level,
            "reference": task.reference_src, "solution": task.solution_src,
            "solution_format": task.solution_format, "speedup": v.speedup, "ref_ms": v.ref_ms,
            "candidate_ms": v.candidate_ms, "hardware": hardware, "mode": v.mode, "min_speedup": min_speedup,
            "verifier_config": cfg.verify.model_dump(mode="json"),
        })
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rejected_path = path.with_name(path.name + ".rejected.jsonl")
    rejected_path.write_text("".join(json.dumps(r) + "\n" for r in rejected))
    summary = {
        "tasks": len(tasks), "with_solution": len(solved), "correct": len(speedups), "accepted": len(rows),
        "verdicts": dict(Counter(v.verdict for v in verdicts).most_common()),
        "speedup_median": statistics.median(speedups) if speedups else None,
        "speedup_geomean": math.exp(statistics.fmean(math.log(x) for x in speedups)) if speedups else None,
        "hardware": hardware, "verifier": verifier_desc, "mode": "gpu" if gpu else "compile_only", "out": str(path),
        "rejected_out": str(rejected_path),
    }
    log(f"kept {len(rows)} of {len(solved)} solution(s) -> {path}")
    return summary
