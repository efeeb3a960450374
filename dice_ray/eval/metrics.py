"""KernelBench's metrics and the unbiased pass@k estimator, per level and overall.

Definitions (KernelBench, Ouyang et al. 2025, arXiv:2502.10517; code:
ScalingIntelligence/KernelBench ``src/score.py`` and ``scripts/benchmark_eval_analysis.py``):

* every task of the evaluated set is in the denominator; a task with no candidate counts as not
  compiled and not correct (KernelBench's ``patch`` of missing results);
* **one sample a task**: KernelBench's analysis keeps only ``sample_id == 0`` ("for now we only
  consider sample_id = 0"), so compiled %, correct %, fast_p and the geomean speedup here are
  computed on each task's **first** sample; the other samples only enter pass@k;
* ``fast_p`` = share of tasks whose first sample is correct **and** has ``speedup > p``
  (strictly), so ``fast_0`` equals correct %; ``fast_1`` beats PyTorch eager, ``fast_2`` doubles it;
* geomean speedup: geometric mean of the speedups of the correct first samples (None when none);
* ``pass@k`` (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1):
  per task ``1 - C(n - c, k) / C(n, k)`` for ``n`` samples of which ``c`` are correct, averaged
  over tasks (a task without samples adds 0); undefined (None) when some task has between 1
  and ``k - 1`` samples.

A candidate is correct when its verdict is ``ok`` and ``correct is True``.  Correctness and speed
exist only for verdicts measured on a GPU (``mode == "gpu"``): for a group holding any
compile-only verdict, every correctness-based metric is None (not measured), never 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

#: speedup thresholds reported by default (KernelBench's fast_0, fast_1, fast_2)
DEFAULT_PS: tuple[float, ...] = (0.0, 1.0, 2.0)
#: pass@k values reported by default (those not larger than the smallest sample count)
DEFAULT_KS: tuple[int, ...] = (1, 5, 10)


class Scored(Protocol):
    """What the metrics read of a verdict (:class:`dice_ray.verify.verdict.Verdict` has it all)."""

    verdict: str
    compiled: bool
    correct: bool | None
    speedup: float | None
    mode: str


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task (Chen et al. 2021, eq. 1): ``1 - C(n-c, k) / C(n, k)``.

    Computed as ``1 - prod_{i=n-c+1}^{n} (1 - k / i)`` (the numerically stable form of the paper's
    code); 1.0 when ``n - c < k`` (every draw of k holds a correct one).

    Args:
        n: samples drawn for the task (>= 1).
        c: correct samples among them (0 <= c <= n).
        k: samples the metric allows (1 <= k <= n).

    Raises:
        TypeError: ``n``, ``c`` or ``k`` is not an int.
        ValueError: ``n < 1``, ``c`` outside ``[0, n]``, or ``k`` outside ``[1, n]`` (pass@k with
            ``k > n`` is undefined for the estimator).
    """
    for name, v in (("n", n), ("c", c), ("k", k)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"pass_at_k: {name} must be an int, got {v!r}")
    if n < 1:
        raise ValueError(f"pass_at_k: n must be >= 1, got {n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: c must lie in [0, n={n}], got {c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k must lie in [1, n={n}], got {k} (pass@k needs at least k samples)")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def is_correct(v: Scored) -> bool:
    """True when the verdict says ``ok`` and its correctness was measured and passed."""
    return v.verdict == "ok" and v.correct is True


def group_metrics(
    samples: Sequence[Sequence[Scored]],
    ps: Iterable[float] = DEFAULT_PS,
    ks: Iterable[int] = DEFAULT_KS,
) -> dict[str, Any]:
    """Metrics of one group of tasks (a level, or all of them).

    Args:
        samples: per task, its verdicts in sample order (an empty list: the task got no candidate,
            it counts as failed).
        ps: fast_p thresholds (>= 0).
        ks: pass@k values (>= 1); a k larger than some task's sample count gives None.

    Returns:
        ``{"tasks", "samples", "measured", "compiled", "correct", "fast_p": {"0": ..., "1": ...},
        "geomean_speedup", "pass_at_k": {"1": ...}}``; rates are fractions in [0, 1];
        ``measured`` is False when any verdict is compile-only, and then ``correct``, ``fast_p``,
        ``geomean_speedup`` and ``pass_at_k`` values are None.  An empty group has rates None.

    Raises:
        ValueError: a negative ``p`` or a ``k < 1``.
    """
    ps, ks = list(ps), list(ks)
    if any(p < 0 for p in ps):
        raise ValueError(f"fast_p thresholds must be >= 0, got {ps}")
    if any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in ks):
        raise ValueError(f"pass@k values must be ints >= 1, got {ks}")
    n_tasks = len(samples)
    flat = [v for task in samples for v in task]
    measured = bool(flat) and all(v.mode == "gpu" for v in flat)
    out: dict[str, Any] = {
        "tasks": n_tasks,
        "samples": len(flat),
        "measured": measured,
        "compiled": None,
        "correct": None,
        "fast_p": {_key(p): None for p in ps},
        "geomean_speedup": None,
        "pass_at_k": {str(k): None for k in ks},
    }
    if n_tasks == 0:
        return out
    firsts = [task[0] if task else None for task in samples]
    out["compiled"] = sum(bool(v is not None and v.compiled) for v in firsts) / n_tasks
    if not measured:
        return out
    correct_first = [v for v in firsts if v is not None and is_correct(v)]
    out["correct"] = len(correct_first) / n_tasks
    speedups = [v.speedup for v in correct_first if v.speedup is not None and v.speedup > 0]
    for p in ps:
        out["fast_p"][_key(p)] = sum(s > p for s in speedups) / n_tasks
    if speedups:
        out["geomean_speedup"] = math.exp(sum(math.log(s) for s in speedups) / len(speedups))
    sampled = [task for task in samples if task]
    min_n = min((len(task) for task in sampled), default=0)
    for k in ks:
        if k <= min_n:  # a task without samples adds 0 (failed)
            out["pass_at_k"][str(k)] = sum(
                pass_at_k(len(task), sum(map(is_correct, task)), k) for task in sampled
            ) / n_tasks
    return out


def compute_metrics(
    tasks: Sequence[tuple[str, int]],
    verdicts: Mapping[str, Sequence[Scored]],
    ps: Iterable[float] = DEFAULT_PS,
    ks: Iterable[int] = DEFAULT_KS,
) -> dict[str, Any]:
    """Per-level and overall metrics (:func:`group_metrics`) of an evaluated task set.

    Args:
        tasks: ``(task_id, level)`` of every evaluated task (the denominator).
        verdicts: task id -> its verdicts in sample order; a task absent here counts as failed.
        ps, ks: see :func:`group_metrics`.

    Returns:
        ``{"overall": {...}, "levels": {"1": {...}, ...}}`` (levels in increasing order).

    Raises:
        ValueError: a task id appears twice in ``tasks``, or ``verdicts`` names a task not in
            ``tasks``; see :func:`group_metrics`.
    """
    ps, ks = list(ps), list(ks)
    ids = [tid for tid, _ in tasks]
    if len(set(ids)) != len(ids):
        raise ValueError("compute_metrics: task ids in tasks must be unique")
    unknown = sorted(set(verdicts) - set(ids))
    if unknown:
        raise ValueError(f"compute_metrics: verdicts for tasks not in tasks: {unknown[:5]}")
    levels: dict[int, list[Sequence[Scored]]] = {}
    for tid, level in tasks:
        levels.setdefault(level, []).append(verdicts.get(tid, []))
    return {
        "overall": group_metrics([verdicts.get(tid, []) for tid in ids], ps, ks),
        "levels": {str(lvl): group_metrics(levels[lvl], ps, ks) for lvl in sorted(levels)},
    }


def _key(p: float) -> str:
    """``"1"`` for 1.0, ``"1.5"`` for 1.5: the JSON key of a threshold."""
    return f"{p:g}"
