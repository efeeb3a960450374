"""The run's fixed evaluations, at its start and its end: the reward on a fixed set of training prompts and the rates
on held-out tasks, each phase, sampled with fixed seeds apart from the training ones and verified by the run's
verifier pool. The start's figures are kept in the run folder (:data:`START_EVAL_FILE`) for a resumed run's summary.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from rich.console import Console

from dice_ray.cluster.console import describe_heldout, describe_train_eval, waiting
from dice_ray.cluster.pipeline import verify_items
from dice_ray.cluster.rollout import GroupRollout, tasks_of
from dice_ray.cluster.scheduler import PromptRequest
from dice_ray.cluster.step_record import rates
from dice_ray.config import DiceConfig
from dice_ray.tasks.prompts import infill_blocker
from dice_ray.tasks.task import Task

#: the start evaluations of a run (training prompts, held-out tasks), kept for the summary of a resumed run
START_EVAL_FILE = "eval_start.json"


#: seed bases of the evaluations' samples (prompt i: base + i), apart from the training seeds
#: (``rl.seed * 1_000_003 + step * 1000 + i``)
HELDOUT_SEED, TRAIN_EVAL_SEED = 7919, 104_729


def spread(items: list, k: int) -> list:
    """``k`` items spread evenly over ``items`` (all of them when there are at most ``k``), first and last included."""
    if len(items) <= k:
        return list(items)
    return [items[round(i * (len(items) - 1) / max(k - 1, 1))] for i in range(k)]


def eval_figures(groups: list[GroupRollout], verdicts: list, tasks: dict) -> dict:
    """Figures of an evaluation's samples: :func:`~dice_ray.cluster.step_record.rates`, ``tasks``, ``compile_only``
    (no verdict measured more than compiling), ``computes``: the share of the rewarded candidates whose kernels
    match their task's solution up to names (:func:`dice_ray.eval.kernel_match.computes`: not an empty or trivial
    kernel paid by a compile-only proxy), None when none was rewarded, and ``slow_share``: of the rewarded
    candidates that reproduce one of their task's honest solutions, the share that reproduce a slower variant
    (:func:`dice_ray.eval.kernel_match.slower_variant`; None when no task has variants or none was rewarded)."""
    from dice_ray.eval.kernel_match import computes, slower_variant

    flat = [(g, c) for g in groups for c in g.candidates]
    rewarded = [(g, c) for (g, c), v in zip(flat, verdicts) if v.reward > 0]
    match = [computes(c, tasks[g.request.task_id]) for g, c in rewarded]
    slow = [s for s in (slower_variant(c, tasks[g.request.task_id]) for g, c in rewarded) if s is not None]
    return {**rates(verdicts), "tasks": len(groups),
            "compile_only": bool(verdicts) and all(v.mode == "compile_only" for v in verdicts),
            "computes": sum(match) / len(match) if match else None,
            "slow_share": sum(slow) / len(slow) if slow else None}


@dataclass
class Evaluations:
    """The evaluations of one run, on its actors.

    Attributes:
        cfg: the run's config (``eval`` section: tasks and samples; ``phase.scaffold_granularity``).
        console: where each evaluation's line goes.
        rollout_workers: the run's rollout worker actors (the prompts are dealt round-robin).
        pool: the run's :class:`~dice_ray.cluster.verifier_pool.VerifierPool` actor.
        tasks: every task of the run by id.
        pools: each phase's training tasks (``{"infill": [...], "e2e": [...]}``).
        heldout: the held-out tasks (the first ``eval.heldout_tasks`` are evaluated).
        unfit: ``(task_id, phase)`` of the prompts too long for the model (left out).
    """

    cfg: DiceConfig
    console: Console
    rollout_workers: list
    pool: Any
    tasks: dict[str, Task]
    pools: dict[str, list[Task]]
    heldout: list[Task]
    unfit: set[tuple[str, str]]

    def at_start(self, run_dir: Path, resume: bool) -> dict:
        """``train_start`` and ``heldout_start``: evaluated now and kept in ``START_EVAL_FILE``, or, resuming, read
        back from there (they belong to the run's first session)."""
        path = run_dir / START_EVAL_FILE
        if resume:
            return json.loads(path.read_text()) if path.exists() else {"train_start": None, "heldout_start": None}
        start = {"train_start": self.train_eval("start"), "heldout_start": self.heldout_eval("start")}
        path.write_text(json.dumps(start, indent=1))
        return start

    def at_end(self) -> dict:
        """``train_end`` and ``heldout_end``."""
        return {"train_end": self.train_eval("end"), "heldout_end": self.heldout_eval("end")}

    def heldout_eval(self, when: str) -> dict | None:
        """Compile (and, on GPUs, correct) rates of samples on held-out tasks, per phase (None: no held-out task)."""
        tasks = self.heldout[: self.cfg.eval.heldout_tasks]
        if not tasks:
            return None
        gran = self.cfg.phase.scaffold_granularity
        pools = {"infill": [t for t in tasks if infill_blocker(t, gran) is None and (t.task_id, "infill") not in self.unfit],
                 "e2e": [t for t in tasks if (t.task_id, "e2e") not in self.unfit]}
        with waiting(self.console, f"held-out ({when}): sampling and verifying {len(tasks)} task(s)"):
            out = self._evaluate(f"eval-{when}", pools, HELDOUT_SEED, self.cfg.eval.heldout_samples)
        self.console.print(f"[bold]held-out ({when})[/] {describe_heldout(out)}")
        return out

    def train_eval(self, when: str) -> dict | None:
        """The reward on a fixed set of training prompts, per phase: ``eval.train_tasks`` tasks of each phase's pool
        (spread over it in curriculum order), ``eval.samples`` samples each, seeds fixed and apart from the training
        ones, so the start and the end (and two runs from one warm start) sample the same prompts with the same
        seeds. None with ``eval.train_tasks=0``."""
        k = self.cfg.eval.train_tasks
        if not k:
            return None
        pools = {phase: spread(sorted(pool, key=lambda t: (t.level, t.task_id)), k) for phase, pool in self.pools.items()}
        with waiting(self.console, f"training prompts ({when}): sampling and verifying"):
            out = self._evaluate(f"train-{when}", pools, TRAIN_EVAL_SEED, self.cfg.eval.samples)
        self.console.print(f"[bold]training prompts ({when})[/] {describe_train_eval(out)}")
        return out

    def _evaluate(self, tag: str, pools: dict[str, list], seed: int, samples: int) -> dict:
        """``{phase: figures}`` of ``samples`` samples a task of each phase's tasks (:func:`eval_figures`)."""
        out = {}
        for phase, tasks in pools.items():
            if not tasks:
                continue
            reqs = [PromptRequest(f"{tag}-{phase}-{i}", t.task_id, phase, seed + i) for i, t in enumerate(tasks)]
            n = len(self.rollout_workers)
            refs = [w.generate.remote(reqs[i::n], samples, tasks_of(reqs[i::n], self.tasks))
                    for i, w in enumerate(self.rollout_workers) if reqs[i::n]]
            groups = [g for part in ray.get(refs) for g in part]
            out[phase] = eval_figures(groups, self.verify(groups), self.tasks)
        return out

    def verify(self, groups: list[GroupRollout]) -> list:
        """Verdicts of every candidate of ``groups`` (blocking), in order."""
        return ray.get(self.pool.verify_batch.remote(verify_items(groups, self.tasks)))
