"""The driver loop of ``dice-ray train``: DICE's bi-phase RL (BiC-RL) on a Ray cluster.

Each step reads like the algorithm (slime's ``train.py`` shape): the phase scheduler picks prompts,
rollout workers sample groups, the verifier pool gives one verdict a candidate, the learner takes a
GRPO-family step on group advantages, the new weights reach the rollout workers, and the step is
recorded, exported and checkpointed. With ``rl.max_staleness > 0`` the rollouts and verification of
the next steps run while the learner trains (:class:`~dice_ray.cluster.pipeline.StepPipeline`); each
step records its stage timings, busy shares and sample staleness (:mod:`dice_ray.cluster.metrics`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shlex
import shutil
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

import ray
import torch
import yaml
from rich.console import Console
from rich.markup import escape
from rich.rule import Rule
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dice_ray.cluster.auth import connect
from dice_ray.cluster.errors import error_line
from dice_ray.cluster.learner import LearnerGroup, TrainGroup, learner_env, make_train_group
from dice_ray.cluster.metrics import GpuBusySampler, RunMetrics, StageTimeline
from dice_ray.cluster.pipeline import Flight, StepPipeline, staleness_stats, verify_items
from dice_ray.cluster.rollout import ROLLOUT_MAX_RESTARTS, GroupRollout, RolloutWorker, tasks_of
from dice_ray.cluster.scheduler import NAMESPACE, SCHEDULER_NAME, PhaseSchedulerActor, PromptRequest, StepPlan
from dice_ray.cluster.storage import CheckpointStore, run_store_url
from dice_ray.cluster.verifier_pool import POOL_NAME, VerifierPool
from dice_ray.cluster.weight_sync import WeightSync, resolve_mode
from dice_ray.config import DEEPSPEED_OPS_DIR, DiceConfig, load_config
from dice_ray.report import STOPPED_FILE, plot_curves, read_metrics
from dice_ray.rl.advantages import group_advantages
from dice_ray.tasks.loaders import load_tasks, phase_pool, select_tasks, split_tasks
from dice_ray.tasks.prompts import infill_blocker
from dice_ray.verify.verifier import AUTO_GPU_WORKERS

COLUMNS = [
    ("step", 4, "{:d}"), ("phase", 6, "{}"), ("infill", 6, "{:.2f}"), ("reward", 6, "{:.3f}"), ("±std", 4, "{:.2f}"),
    ("compile", 7, "{:.0%}"), ("correct", 7, "{:.0%}"), ("cheat", 5, "{:.0%}"), ("speedup", 7, "{:.2f}x"),
    ("drop", 4, "{:d}"), ("loss", 8, "{:+.1e}"), ("sec", 5, "{:.1f}"),
]  # 80 columns with the spaces between: an 80-column terminal shows a row on one line


#: the logger of Ray's (>= 2.60) notices about token authentication on a local cluster it starts
_RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


def _drop_token_auth_on_notice(record: logging.LogRecord) -> bool:
    """A logging filter: drops Ray's WARNING that the local cluster it starts has token authentication on (the safe
    default; the first line of every run, which new users read as a problem: README, Troubleshooting, says what it
    means for ``ray job submit``); its warning that authentication is *off* still shows."""
    return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


def start_ray(address: str | None) -> dict:
    """Connect to ``address`` (or ``RAY_ADDRESS``), else ``ray.init()``: the cluster ``ray start`` runs on
    this machine, or a new local one with the dashboard (``started`` is True for both).

    Returns:
        ``{"address": ..., "dashboard": url or None, "started": bool}``.
    """
    address = address or os.environ.get("RAY_ADDRESS")
    if not sys.stdout.isatty():  # a log file: actors' lines without colour codes around their "(Actor pid=...)" prefix
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    if ray.is_initialized():
        ctx = ray.get_runtime_context()
        return {"address": ctx.gcs_address, "dashboard": None, "started": False}
    # Ray's own INFO lines ("Started a local Ray instance. View the dashboard at ..." with colour codes in a
    # log file) are left out: the trainer prints the address and the dashboard itself
    if address:
        ctx = connect(address, namespace=NAMESPACE, log_to_driver=True, logging_level="WARNING")  # Ray >= 2.60's token
        started = False
    else:
        logging.getLogger(_RAY_AUTH_LOGGER).addFilter(_drop_token_auth_on_notice)
        ctx = ray.init(namespace=NAMESPACE, include_dashboard=True, dashboard_host="127.0.0.1", log_to_driver=True,
                       logging_level="WARNING")
        started = True
    url = ctx.dashboard_url
    return {"address": ctx.address_info.get("gcs_address"), "dashboard": f"http://{url}" if url else None, "started": started}


def describe_warm_start(report: dict, steps_max: int, target_loss: float | None) -> str:
    """One line for the console from the learner's warm-start report (:class:`~dice_ray.policy.sft.SFTReport`
    as a dict: ``steps``, ``final_loss`` (nats a masked token), ``seconds``, ``cache_hit``, ``cache_key``,
    ``num_pairs``, ``losses`` as ``[(step, loss), ...]``), e.g. ``658 SFT steps on 176 pairs in 24.0 s, loss
    6.36 -> 0.068; stopped at step 658 of 800: loss below sft.target_loss=0.08; cached as 2efde44e0b59``."""
    key = str(report.get("cache_key", ""))[:12]
    final = report.get("final_loss")
    if report.get("cache_hit"):
        loss = f", final loss {final:.3f}" if isinstance(final, float) and math.isfinite(final) else ""
        return f"from the SFT cache ({key}): {report.get('num_pairs')} (prompt, solution) pairs{loss}"
    losses = report.get("losses") or []
    line = (f"{report.get('steps')} SFT steps on {report.get('num_pairs')} (prompt, solution) pairs in "
            f"{report.get('seconds', 0.0):.1f} s")
    if len(losses) > 1:
        line += f", loss {losses[0][1]:.2f} -> {losses[-1][1]:.3f}"
    elif losses:  # one logged step: no trend to show
        line += f", loss {losses[0][1]:.3f}"
    if report.get("steps", 0) < steps_max:
        line += f"; stopped at step {report.get('steps')} of {steps_max}: loss below sft.target_loss={target_loss}"
    return f"{line}; cached as {key}" if key else line


#: a ``deepspeed.initialize`` this slow (s) is named on the learner line (the first run builds DeepSpeed's ops)
SLOW_DEEPSPEED_S = 5.0


def describe_learner(info: dict) -> str:
    """One line for the console from the learner's ``init_engine`` report (``family``, ``model``, ``params``,
    ``zero_stage``, ``backend``, ``ranks``, ``device``, ``seconds``; ``fused_kernels`` named when not empty,
    ``fused_kernels_off``, why ``auto`` left them off on a GPU, and ``deepspeed_seconds``, named when
    ``deepspeed.initialize`` took :data:`SLOW_DEEPSPEED_S` or more: it builds its ops the first time), e.g.
    ``sdar policy, 0.55 M params, built, warm-started by SFT; DeepSpeed ZeRO-0 over gloo, 1 rank(s) on cpu; ready in
    1.3 s`` (on a GPU with Liger: ``... on cuda:0, fused kernels: swiglu, rope (Liger); ready in ...``)."""
    return (f"{info.get('family')} policy, {info.get('params', 0) / 1e6:.2f} M params, {info.get('model')}; "
            f"DeepSpeed ZeRO-{info.get('zero_stage')} over {info.get('backend')}, {info.get('ranks')} rank(s) on "
            f"{info.get('device')}"
            + (f", fused kernels: {', '.join(info['fused_kernels'])} (Liger)" if info.get("fused_kernels") else "")
            + (f", fused kernels off (cluster.fused_kernels=auto: {info['fused_kernels_off']})"
               if info.get("fused_kernels_off") else "")
            + f"; ready in {info.get('seconds', 0.0):.1f} s"
            + (f" (DeepSpeed's set-up {info['deepspeed_seconds']:.1f} s of it: it builds its ops on first use, then "
               f"caches them in {DEEPSPEED_OPS_DIR})" if info.get("deepspeed_seconds", 0.0) >= SLOW_DEEPSPEED_S
               else ""))


def describe_heldout(out: dict) -> str:
    """One line from :meth:`Trainer.heldout_eval`'s ``{phase: {"candidates", "tasks", "compile_rate",
    "ok_rate", "correct_rate", "compile_only"}}``, e.g. ``infill: 8 candidates (4 held-out tasks), 25.0% compile, 12.5% ok, correctness
    not measured (compile-only verifier); e2e: ...`` (``... (nothing compiled)`` on a GPU verifier when no
    candidate compiled)."""
    parts = []
    for phase, fig in out.items():
        correct = fig.get("correct_rate")
        why = "compile-only verifier" if fig.get("compile_only") else "nothing compiled"
        said = f"{correct:.1%} correct" if correct is not None else f"correctness not measured ({why})"
        n = fig.get("tasks")
        tasks = f" ({n} held-out task{'' if n == 1 else 's'})" if n else ""
        ok = f", {fig['ok_rate']:.1%} ok" if fig.get("ok_rate") is not None else ""  # none in an older run's eval_start.json
        parts.append(f"{phase}: {fig.get('candidates')} candidates{tasks}, {fig.get('compile_rate', 0.0):.1%} compile"
                     f"{ok}, {said}")
    return "; ".join(parts) or "no eligible task"


#: seed bases of the evaluations' samples (prompt i: base + i), apart from the training seeds
#: (``rl.seed * 1_000_003 + step * 1000 + i``)
HELDOUT_SEED, TRAIN_EVAL_SEED = 7919, 104_729


def spread(items: list, k: int) -> list:
    """``k`` items spread evenly over ``items`` (all of them when there are at most ``k``), first and last included."""
    if len(items) <= k:
        return list(items)
    return [items[round(i * (len(items) - 1) / max(k - 1, 1))] for i in range(k)]


def eval_figures(groups: list[GroupRollout], verdicts: list, tasks: dict) -> dict:
    """Figures of an evaluation's samples: :func:`rates`, ``tasks``, ``compile_only`` (no verdict measured more than
    compiling) and ``computes``: the share of the rewarded candidates whose kernels match their task's solution up to
    names (:func:`dice_ray.eval.kernel_match.computes`: not an empty or trivial kernel paid by a compile-only proxy),
    None when none was rewarded."""
    from dice_ray.eval.kernel_match import computes

    flat = [(g, c) for g in groups for c in g.candidates]
    rewarded = [(g, c) for (g, c), v in zip(flat, verdicts) if v.reward > 0]
    match = [computes(c, tasks[g.request.task_id]) for g, c in rewarded]
    return {**rates(verdicts), "tasks": len(groups),
            "compile_only": bool(verdicts) and all(v.mode == "compile_only" for v in verdicts),
            "computes": sum(match) / len(match) if match else None}


def describe_train_eval(out: dict) -> str:
    """One line from :meth:`Trainer.train_eval`, e.g. ``infill: reward 0.62 over 32 candidates (8 tasks), 66% compile;
    e2e: ...``."""
    return "; ".join(f"{phase}: reward {f['reward_mean']:.3f} over {f['candidates']} candidates ({f['tasks']} tasks), "
                     f"{f['compile_rate']:.0%} compile" for phase, f in out.items()) or "no task"


def describe_summary(summary: dict) -> str:
    """Two lines for the console from the run's summary (what ``summary.json`` holds; the held-out lines are
    printed before it), e.g. ``10 steps (phases infill, ramp, e2e), 332.9 s with the warm start and held-out
    evaluations, verifier compile-only`` (a resumed run: ``12 steps (...), 2 of them in this run, resumed at step
    10: 35.0 s with the final held-out evaluation, ...``) / ``reward 0.391 -> 0.016; last step: compile 2%, correct n/a, cheat 0%,
    speedup n/a; 47 groups dropped (...)``, and when the last step's verdict counts are known a third line,
    ``last step's verdicts: compile_error 43, ok 21``."""
    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.0%}"

    final = summary.get("final") or {}
    first_last = summary.get("reward_mean_first_last") or [None, None]
    order = {"infill": 0, "ramp": 1, "e2e": 2}
    phases = ", ".join(sorted(summary.get("phases_seen") or [], key=lambda p: order.get(p, 3)))
    speedup = final.get("speedup_geomean")
    resumed, steps, seconds = summary.get("resumed_at_step"), summary.get("steps"), summary.get("seconds", 0.0)
    ran = f"{steps} steps (phases {phases or 'none'}), "
    evaluated = summary.get("heldout_end") is not None  # None: no held-out task, or eval.heldout_tasks=0
    if resumed is None:
        ran += f"{seconds:.1f} s with the warm start" + (" and held-out evaluations" if evaluated else "")
    else:  # the warm start and the first held-out evaluation belong to the first run
        ran += f"{steps - resumed} of them in this run, resumed at step {resumed}: {seconds:.1f} s" \
               + (" with the final held-out evaluation" if evaluated else "")
    lines = [
        f"{ran}, verifier "
        f"{'compile-only' if summary.get('verifier_mode') == 'compile_only' else summary.get('verifier_mode')}",
        (f"reward {first_last[0]:.3f} -> {first_last[1]:.3f}; " if None not in first_last else "")
        + f"last step: compile {pct(final.get('compile_rate'))}, correct {pct(final.get('correct_rate'))}, cheat "
        f"{pct(final.get('cheat_rate'))}, speedup {'n/a' if speedup is None else f'{speedup:.2f}x'}; "
        f"{summary.get('groups_dropped_total', 0)} groups dropped (all rewards equal: no advantage)",
    ]
    learned = describe_learning(summary.get("train_start"), summary.get("train_end"))
    if learned:
        lines.append(learned)
    verdicts = final.get("verdicts")
    if verdicts:  # a last line: what the rates above are made of
        lines.append("last step's verdicts: " + ", ".join(f"{k} {n}" for k, n in sorted(verdicts.items(), key=lambda kv: -kv[1])))
    return "\n".join(lines)


def describe_learning(start: dict | None, end: dict | None) -> str | None:
    """One line on the reward of the fixed training prompts at the run's start and end, each phase (None without
    both evaluations), e.g. ``training prompts, reward at start -> end: infill 0.41 -> 0.62 (up), e2e 0.12 -> 0.30
    (up)``."""
    if not start or not end:
        return None
    parts = []
    for phase in (p for p in ("infill", "e2e") if p in start and p in end):
        a, b = start[phase]["reward_mean"], end[phase]["reward_mean"]
        parts.append(f"{phase} {a:.3f} -> {b:.3f} ({'up' if b > a else 'down' if b < a else 'same'})")
    return "training prompts, reward at start -> end: " + ", ".join(parts) if parts else None


def correct_rate(verdicts: list) -> float | None:
    """Share of the verdicts whose correctness a GPU verifier measured that matched the reference; None when
    none was measured.  A compile-only verifier measures no correctness: its dry run can still call a wrong
    output shape ``incorrect``, but one such verdict among unmeasured ``ok`` ones is no correct rate of 0 %."""
    measured = [v for v in verdicts if v.correct is not None and v.mode != "compile_only"]
    return sum(bool(v.correct) for v in measured) / len(measured) if measured else None


def speedup_geomean(verdicts: list) -> float | None:
    """Geometric mean of the measured speedups of the correct verdicts; None when there is none."""
    speedups = [v.speedup for v in verdicts if v.correct and v.speedup and v.speedup > 0]
    return math.exp(statistics.fmean(math.log(s) for s in speedups)) if speedups else None


def rates(verdicts: list) -> dict:
    """``candidates``, ``reward_mean``, ``compile_rate`` (the module built: its kernels may still miss what the launch
    code calls), ``ok_rate`` (verdict ``ok``: what a compile-only verifier rewards), ``correct_rate``
    (:func:`correct_rate`) and ``speedup_geomean`` (:func:`speedup_geomean`) of verdicts."""
    n = max(len(verdicts), 1)
    return {"candidates": len(verdicts), "reward_mean": sum(v.reward for v in verdicts) / n,
            "compile_rate": sum(v.compiled for v in verdicts) / n,
            "ok_rate": sum(v.verdict == "ok" for v in verdicts) / n, "correct_rate": correct_rate(verdicts),
            "speedup_geomean": speedup_geomean(verdicts)}


def by_phase(groups: list[GroupRollout], verdicts: list) -> dict:
    """Figures of each phase's prompts in a step: ``{phase: {"prompts", "candidates", "reward_mean", "compile_rate",
    "correct_rate"}}`` for the phases the step sampled (verdicts in group order, one a candidate). The phase
    scheduler's gate reads them."""
    out: dict[str, dict] = {}
    start = 0
    for g in groups:
        end = start + len(g.candidates)
        entry = out.setdefault(g.request.phase, {"prompts": 0, "verdicts": []})
        entry["prompts"] += 1
        entry["verdicts"] += verdicts[start:end]
        start = end
    return {phase: {"prompts": e["prompts"], **rates(e["verdicts"])} for phase, e in out.items()}


def step_record(plan: StepPlan, groups: list[GroupRollout], verdicts: list, dropped: int) -> dict:
    """Per-step figures from verdicts: reward mean/std, compile / correct / cheat rates, speedup geomean, the
    prompts of each phase (``prompts_infill``, ``prompts_e2e``; ``infill_fraction`` is the share actually sampled,
    ``infill_target`` the curriculum's), each phase's figures (:func:`by_phase`) and the curriculum's decision."""
    rewards = [v.reward for v in verdicts]
    counts: dict[str, int] = {}
    for v in verdicts:
        counts[v.verdict] = counts.get(v.verdict, 0) + 1
    decision = asdict(plan.decision) if plan.decision is not None else None
    return {
        "step": plan.step,
        "phase": plan.stage,
        "infill_fraction": plan.infill_fraction,
        "infill_target": plan.infill_target,
        "prompts_infill": sum(r.phase == "infill" for r in plan.requests),
        "prompts_e2e": sum(r.phase == "e2e" for r in plan.requests),
        **rates(verdicts),  # candidates, reward_mean, compile_rate, correct_rate, speedup_geomean
        "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "cheat_rate": counts.get("cheat", 0) / max(len(verdicts), 1),
        "verdicts": counts,
        "groups": len(groups),
        "groups_dropped": dropped,
        "verifier_mode": verdicts[0].mode if verdicts else None,
        "by_phase": by_phase(groups, verdicts),
        "phase_decision": decision,
        "gate_figure": decision.get("value") if decision else None,
    }


class Trainer:
    """Owns one run: its Ray actors, its run directory and the loop.

    Args:
        cfg: the resolved config.
        run_dir: the run directory (made if missing).
        resume: continue from the last checkpoint in ``run_dir``.
        console: where progress goes.
    """

    def __init__(self, cfg: DiceConfig, run_dir: Path, resume: bool = False, console: Console | None = None):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.resume = resume
        # a terminal wraps at its width; a log (ray job logs, a file) keeps each line whole
        self.console = console or (Console() if Console().is_terminal else Console(soft_wrap=True, width=160))
        self.ckpt_dir = self.run_dir / "checkpoints"  # the checkpoints, or their staging folder with storage_path
        self.store = CheckpointStore(run_store_url(cfg.storage_path, self.run_dir.name)) if cfg.storage_path else None
        self.start_step = 0
        self.weights_version = 0

    # ---- set-up -------------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg, con = self.cfg, self.console
        # the tasks first, then Ray: a bad tasks.spec or address fails before a run folder exists
        report = load_tasks(cfg.tasks.spec, max_input_elements=cfg.tasks.max_input_elements)
        tasks = select_tasks(report.tasks, cfg.tasks.max_tasks, cfg.tasks.solution_variants)
        if not tasks:
            raise ValueError(f"tasks.spec={cfg.tasks.spec!r}: no task accepted ({report.summary()}): "
                             + "; ".join(report.rejection_lines(5)))
        self.ray_info = start_ray(cfg.cluster.address)  # an unreachable address fails before the run folder exists
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / STOPPED_FILE).unlink(missing_ok=True)  # a session starts: the last one's early end is history
        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        con.print(f"[bold]ray[/] {self.ray_info['address']}  dashboard: {self.ray_info['dashboard']}")
        con.print(f"[bold]tasks[/] {report.summary()}")
        for line in report.rejection_lines():
            con.print(f"  {line}", markup=False, highlight=False)
        self.train_tasks, self.heldout = split_tasks(tasks, cfg.tasks.heldout_fraction)
        self.tasks = {t.task_id: t for t in tasks}
        con.print(f"[bold]split[/] {len(self.train_tasks)} training tasks, {len(self.heldout)} held out")
        if cfg.eval.heldout_tasks and not self.heldout:
            con.print(f"[yellow]no held-out tasks[/]: eval.heldout_tasks={cfg.eval.heldout_tasks} is skipped "
                      f"(tasks.heldout_fraction={cfg.tasks.heldout_fraction} of {len(tasks)} tasks holds none out)")

        gpus = int(ray.cluster_resources().get("GPU", 0))
        if cfg.cluster.fused_kernels == "liger" and not gpus:  # learner_gpus > 0 is checked with the config
            raise ValueError("cluster.fused_kernels='liger' needs a GPU learner, and this Ray cluster has no GPU "
                             "(Liger's Triton kernels run on CUDA only): set fused_kernels to 'auto' or 'none'")
        self.metrics = RunMetrics(self.run_dir.name)
        n_verifiers = cfg.cluster.num_verifiers or (gpus if gpus else 2)
        gpus_per_verifier = cfg.cluster.verifier_gpus if gpus and cfg.verify.mode != "compile_only" else 0.0
        # a call's own stage limits, plus waiting for the GPU gate behind the actor's other workers
        workers = cfg.verify.workers or (AUTO_GPU_WORKERS if gpus_per_verifier else 1)
        call_timeout = cfg.verify.compile_timeout_s + (3 + workers) * cfg.verify.run_timeout_s + 60
        self.pool = VerifierPool.options(name=POOL_NAME, namespace=NAMESPACE).remote(
            cfg.verify, cfg.reward, n_verifiers, gpus_per_verifier, call_timeout, cfg.cluster
        )
        threads = 0 if gpus else max(1, (os.cpu_count() or 2) // 2)
        self.rollout_workers = [
            # restartable, no task retries: a restarted worker must be re-synced before it samples (pipeline.py)
            RolloutWorker.options(
                num_gpus=cfg.cluster.rollout_gpus if gpus else 0, max_restarts=ROLLOUT_MAX_RESTARTS, max_task_retries=0
            ).remote(
                cfg.model, cfg.sampling, cfg.tasks.prompt_template, threads, cfg.phase.scaffold_granularity
            )
            for _ in range(cfg.cluster.num_rollout_workers)
        ]
        self.pools = self._phase_pools()
        self.scheduler = PhaseSchedulerActor.options(name=SCHEDULER_NAME, namespace=NAMESPACE).remote(
            [(t.task_id, t.level) for t in self.pools["infill"]], [(t.task_id, t.level) for t in self.pools["e2e"]],
            cfg.phase, cfg.rl.prompts_per_step, cfg.rl.seed, cfg.rl.max_staleness, bool(self.resume)
        )
        use_gpu = bool(gpus and cfg.cluster.learner_gpus)
        ranks = cfg.cluster.learner_ranks
        self.learner = LearnerGroup(cfg, use_gpu, max(1, threads // ranks) if threads else 0, learner_env(use_gpu))
        sync_mode, sync_backend = resolve_mode(
            cfg.cluster.weight_sync, cfg.cluster.learner_gpus if use_gpu else 0.0, cfg.cluster.rollout_gpus if gpus else 0.0, gpus
        )
        self.weight_sync = WeightSync(self.learner, self.rollout_workers, sync_mode, sync_backend, cfg.cluster.weight_sync_bucket_mb,
                                      keep_versions=cfg.rl.max_staleness + 1)
        con.print(
            f"[bold]actors[/] scheduler, {len(self.rollout_workers)} rollout worker(s), "
            f"{n_verifiers} verifier(s) ({'GPU' if gpus_per_verifier else 'CPU, compile-only'}), "
            f"learner ({ranks} rank(s), {'GPU, NCCL' if use_gpu else 'CPU, gloo'}, ZeRO-{cfg.cluster.zero_stage}), "
            f"weight sync {sync_mode}{f' ({sync_backend})' if sync_mode == 'broadcast' else ''}"
        )
        ray.get(self.pool.status.remote())
        # the verifiers measure every task's reference facts now, while idle (the warm start), not in its first group
        self.pool.prepare.remote(self.train_tasks + self.heldout[: cfg.eval.heldout_tasks])

        if self.resume:
            with waiting(con, "resume: the learner starts, then loads the newest checkpoint"):
                self._restore()
        else:
            if self._warm_start():
                info = ray.get(self.learner.init_engine.remote())
            else:
                with waiting(con, "learner: starting (policy, DeepSpeed engine)"):
                    info = ray.get(self.learner.init_engine.remote())
            con.print(f"[bold]learner[/] {describe_learner(info)}")
        self._sync_weights()

    def _phase_pools(self) -> dict[str, list]:
        """The training tasks each phase draws from (:func:`~dice_ray.tasks.loaders.phase_pool`); a task of the
        infilling set that cannot be infilled (no solution, nothing to cut) is left out and counted here, once, by
        reason."""
        gran = self.cfg.phase.scaffold_granularity
        candidates = {"infill": phase_pool(self.train_tasks, "infill"), "e2e": phase_pool(self.train_tasks, "e2e")}
        blocked = {t.task_id: infill_blocker(t, gran) for t in candidates["infill"]}
        candidates["infill"] = [t for t in candidates["infill"] if blocked[t.task_id] is None]
        self.unfit = self._unfit({**candidates, "held-out": self.heldout[: self.cfg.eval.heldout_tasks]})
        pools = {phase: [t for t in tasks if (t.task_id, phase) not in self.unfit] for phase, tasks in candidates.items()}
        split = len(blocked) < len(self.train_tasks) or len(candidates["e2e"]) < len(self.train_tasks)
        line = (f"[bold]phases[/] infilling: {len(pools['infill'])} of {len(blocked)} tasks (scaffold granularity {gran}); "
                f"end-to-end: {len(pools['e2e'])} of {len(candidates['e2e'])} tasks"
                + (" (each phase from its own task set)" if split else ""))
        self.console.print(line)
        reasons = Counter(r for r in blocked.values() if r is not None)
        reasons.update(f"the {phase} prompt and sampling.max_new_tokens={self.cfg.sampling.max_new_tokens} exceed "
                       f"model.max_position_embeddings={self.cfg.model.max_position_embeddings}"
                       for _, phase in self.unfit)
        for reason, n in reasons.most_common():
            self.console.print(f"  left out: {n} task(s): {escape(reason)}", highlight=False)
        return pools

    def _unfit(self, tasks: dict[str, list]) -> set[tuple[str, str]]:
        """``(task_id, phase)`` of the prompts whose context (measured by a rollout worker, with the policy's tokenizer)
        and ``sampling.max_new_tokens`` more would not fit ``model.max_position_embeddings``; ``tasks`` maps a phase
        (``held-out``: both phases) to its tasks."""
        items = [(t, phase) for key, ts in tasks.items() for t in ts
                 for phase in ((key,) if key in ("infill", "e2e") else ("infill", "e2e"))
                 if phase == "e2e" or infill_blocker(t, self.cfg.phase.scaffold_granularity) is None]
        room = self.cfg.model.max_position_embeddings - self.cfg.sampling.max_new_tokens
        lengths = ray.get(self.rollout_workers[0].context_tokens.remote(items)) if items else []
        return {(t.task_id, phase) for (t, phase), n in zip(items, lengths) if n > room}

    def _warm_start(self) -> bool:
        """Masked-diffusion SFT of the learner's policy on the training tasks' reference solutions; returns whether it
        ran (and so waited for the learner actor to start)."""
        from dice_ray.tasks.prompts import training_pairs

        cfg, con = self.cfg, self.console
        if cfg.model.path:
            con.print(f"[bold]warm start[/] skipped: the policy comes from model.path={cfg.model.path}")
            return False
        if not cfg.sft.enabled:
            return False
        pairs, _ = training_pairs(self.train_tasks, cfg.tasks.prompt_template, cfg.model.family,
                                  cfg.phase.scaffold_granularity)
        if not pairs:
            con.print("[bold]warm start[/] skipped: no training task has a reference solution to learn from")
            return False
        with waiting(con, f"warm start: the learner starts, then masked-diffusion SFT on {len(pairs)} pairs (cached "
                          f"after the first run)"):
            report = ray.get(self.learner.warm_start.remote(pairs))
        con.print(f"[bold]warm start[/] {describe_warm_start(report, cfg.sft.steps, cfg.sft.target_loss)}")
        return True

    def _restore(self) -> None:
        tag = newest_checkpoint_tag(self.store, self.ckpt_dir)
        if self.store is not None:
            if tag is None:
                raise FileNotFoundError(f"--resume {self.run_dir}: no complete checkpoint under {self.store.url}")
            state_path = self.store.fetch(tag, self.ckpt_dir) / "state.json"
            self.console.print(f"[bold]storage[/] fetched {tag} from {self.store.url}")
        elif tag is None:
            raise FileNotFoundError(f"--resume {self.run_dir}: no checkpoint under {self.ckpt_dir}")
        else:
            state_path = self.ckpt_dir / tag / "state.json"
        state = json.loads(state_path.read_text())
        info = ray.get(self.learner.init_engine.remote())
        ray.get(self.learner.load.remote(str(self.ckpt_dir), state_path.parent.name))
        info["model"] = f"restored from {state_path.parent.name}"
        self.console.print(f"[bold]learner[/] {describe_learner(info)}")
        ray.get(self.scheduler.set_state.remote(state["schedule"]))
        self.start_step = state["step"]
        self.weights_version = state["step"]
        metrics = self.run_dir / "metrics.jsonl"
        if metrics.exists():
            kept = [r for r in read_metrics(self.run_dir) if r["step"] < self.start_step]
            metrics.write_text("".join(json.dumps(r) + "\n" for r in kept))
        sched = state["schedule"]
        self.console.print(f"[bold]resumed[/] from {state_path.parent} at step {self.start_step} (the scheduler at "
                           f"step {sched.get('step')}, phase {sched.get('phase')}, infill fraction "
                           f"{sched.get('infill_fraction')})")

    # ---- one RL step, stage by stage -----------------------------------------------------------------
    # rollout and verification of the RL steps go through self.pipeline (StepPipeline: ahead of the
    # learner by up to rl.max_staleness steps); verify() serves the held-out report
    def verify(self, groups: list[GroupRollout]) -> list:
        """Verdicts of every candidate of ``groups`` (blocking), in order."""
        return ray.get(self.pool.verify_batch.remote(verify_items(groups, self.tasks)))

    def learn(self, groups: list[GroupRollout], verdicts: list) -> tuple[Flight | None, int]:
        """Submit the learner step on the groups with a learning signal (group advantages).

        Returns:
            (the learner call in flight, or None when every group was dropped; groups dropped).
        """
        t0 = time.perf_counter()
        g = self.cfg.rl.num_generations
        rewards = torch.tensor([v.reward for v in verdicts], dtype=torch.float32).view(len(groups), g)
        adv = group_advantages(rewards, scale_rewards=self.cfg.rl.scale_rewards)
        batch: list[TrainGroup] = [
            make_train_group(grp.rollouts[0].prompt_ids, grp.rollouts, adv.advantages[i])
            for i, grp in enumerate(groups)
            if adv.keep[i]
        ]
        if not batch or not self.cfg.rl.update_policy:  # nothing to learn from, or the control arm: no update
            return None, adv.num_dropped
        return self.pipeline.submit("learn", [self.learner.train_step.remote(batch)], start=t0), adv.num_dropped

    def _sync_weights(self, wait: bool = True) -> dict:
        """Push the learner's weights to the rollout workers (:class:`WeightSync`); returns :meth:`WeightSync.push`'s
        report (``seconds``, ``restarts``: workers found restarted and re-sent the weights). ``wait=False``:
        queued behind the rollouts launched ahead, not waited for (object store only)."""
        return self.weight_sync.push(self.weights_version, wait=wait)

    @property
    def queued_sync(self) -> bool:
        """Whether the step's weight push is queued behind the rollouts launched ahead instead of waiting
        for them: an asynchronous run (``rl.max_staleness > 0``) syncing through the object store. A
        broadcast is a collective every worker joins at once, so it waits for the rollouts ahead first."""
        return self.cfg.rl.max_staleness > 0 and self.weight_sync.mode == "object_store"

    def checkpoint(self, step: int, schedule: dict | None = None) -> None:
        """Save the learner and the scheduler state as ``step_{step:06d}`` (``schedule``: the state to save
        instead of the scheduler's own, when batches were drawn ahead of the learner)."""
        tag = f"step_{step:06d}"
        ray.get(self.learner.save.remote(str(self.ckpt_dir), tag))
        now = ray.get(self.scheduler.get_state.remote())
        # a batch drawn ahead is drawn again on resume (its state before the draw), with every figure seen so far
        schedule = {**schedule, "figures": now["figures"]} if schedule is not None else now
        state = {"step": step, "schedule": schedule, "time": time.time()}
        (self.ckpt_dir / tag / "state.json").write_text(json.dumps(state, indent=1))  # the completeness marker, last
        keep_local = self.cfg.keep_checkpoints
        if self.store is not None:  # storage_path: copy it there, keep the last K there, only the newest staged
            self.store.upload(self.ckpt_dir / tag)
            self.store.prune(self.cfg.keep_checkpoints)
            keep_local = 1
        tags = sorted(p for p in self.ckpt_dir.iterdir() if p.is_dir() and (p / "state.json").exists())
        for old in tags[:-keep_local]:
            shutil.rmtree(old, ignore_errors=True)

    def train_step(self, show) -> dict:
        """One RL step: prompts -> rollouts -> verdicts -> learner step -> weight sync -> checkpoint.

        With ``rl.max_staleness = s > 0`` the step's prompts were drawn and sampled up to ``s`` steps
        earlier (:meth:`StepPipeline.take` launches the next steps' rollouts before this step waits on
        anything), and the learner's call is waited on while those rollouts run and go to the verifiers.
        Through the object store the weight push is then queued behind those rollouts (:attr:`queued_sync`),
        so the next step starts without waiting for them.

        Args:
            show: called with a short status line as each stage starts.

        Returns:
            the step's record: figures of :func:`step_record`, learner stats, stage timings, busy shares,
            ``timeline`` and ``staleness_max`` / ``staleness_mean`` (see :mod:`dice_ray.cluster.metrics`).

        Raises:
            RuntimeError: a group sampled with weights more than ``rl.max_staleness`` versions old.
        """
        t0 = time.perf_counter()
        pipe = self.pipeline
        batch = pipe.take(self.weights_version)
        step, phase = batch.step, batch.plan.stage
        if batch.plan.decision is not None:
            self._print_decision(batch.plan.decision)
        show(f"step {step} {phase}: rollout")
        groups = pipe.groups(batch)
        show(f"step {step} {phase}: verify {sum(len(g.candidates) for g in groups)}")
        verdicts = pipe.verdicts(batch)
        show(f"step {step} {phase}: learn")
        flight, dropped = self.learn(groups, verdicts)
        learned = pipe.wait(flight)[0] if flight is not None else {}
        self.weights_version = step + 1
        if not self.queued_sync:
            pipe.drain_rollouts()  # a broadcast needs every worker, busy with the rollouts ahead: wait for them
        t_sync = time.perf_counter()
        sync = self._sync_weights(wait=not self.queued_sync)
        sync_s = sync["seconds"]
        self.timeline.add("sync", t_sync, time.perf_counter())
        rec = step_record(batch.plan, groups, verdicts, dropped)
        self.scheduler.observe.remote(rec)  # before the checkpoint: its curriculum state holds this step's figures
        pool = ray.get(self.pool.status.remote())
        rollout_s, verify_s = batch.rollout.seconds, batch.verify.seconds
        rec.update(
            loss=learned.get("loss"), clip_fraction=learned.get("clip_fraction"), kl=learned.get("kl"),
            ratio_mean=learned.get("ratio_mean"), grad_norm=learned.get("grad_norm"), learner_tokens=learned.get("tokens", 0),
            learner_step_seconds=learned.get("seconds", 0.0),
            rollout_seconds=rollout_s, verify_seconds=verify_s, learn_seconds=flight.seconds if flight else 0.0,
            sync_seconds=sync_s,
            rollout_tokens_per_s=sum(g.tokens for g in groups) / max(rollout_s, 1e-9),
            verifier_throughput=len(verdicts) / max(verify_s, 1e-9),
            verifier_queue_depth=pool["queue_depth"], verifier_pool_size=pool["size"],
            weights_version=self.weights_version, **staleness_stats(batch.lags),
            rollout_restarts=batch.restarts + sync.get("restarts", 0),  # shards re-sent / pushes repeated after a worker died
        )
        t_ckpt = time.perf_counter()
        if (step + 1) % self.cfg.checkpoint_every == 0 or step + 1 == self.cfg.rl.steps:
            self.checkpoint(step + 1, pipe.schedule_before(step + 1))
        t_end = time.perf_counter()
        gpu = self.gpu_sampler.window(t0, t_end)
        rec.update(
            self.timeline.window(t0, t_end), checkpoint_seconds=t_end - t_ckpt, gpu_busy_share=gpu,
            gpu_busy_share_mean=statistics.fmean(gpu.values()) if gpu else None,
            gpu_busy_share_min=min(gpu.values()) if gpu else None,
        )
        rec["step_seconds"] = t_end - t0
        return rec

    def record(self, rec: dict) -> None:
        """Append the step to metrics.jsonl, export it to Ray metrics, print its row, and post the finished record
        (its times too) to the scheduler for ``dice-ray status`` (:meth:`train_step` posted its figures for the
        curriculum before the checkpoint)."""
        self.scheduler.report.remote(rec)
        with (self.run_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(rec) + "\n")
        self.metrics.publish(rec)
        self._print_row(rec)

    # ---- evaluations at the start and the end ----------------------------------------------------------
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

    # ---- the loop --------------------------------------------------------------------------------------
    def run(self) -> dict:
        """Run set-up, the RL steps and the final report; returns the summary (also in summary.json)."""
        cfg, con = self.cfg, self.console
        t_run = time.perf_counter()
        self.setup()
        start = self._start_evaluations()
        self._start_pipeline()
        self._print_header()
        with Progress(
            TextColumn("[bold]RL"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.description}"),
            console=con, transient=False,
        ) as bar:
            job = bar.add_task("", total=cfg.rl.steps, completed=self.start_step)
            for _ in range(self.start_step, cfg.rl.steps):
                rec = self.train_step(lambda msg: bar.update(job, description=msg))
                self.record(rec)
                bar.update(job, advance=1, description="")
        self.gpu_sampler.stop()
        end = {"train_end": self.train_eval("end"), "heldout_end": self.heldout_eval("end")}
        return self._finish(t_run, {**start, **end})

    def _start_pipeline(self) -> None:
        """The loop's step pipeline (``rl.max_staleness``), stage timeline and GPU busy sampler.

        A resumed asynchronous run starts with nothing in flight: the steps that were launched ahead
        when the checkpoint was taken are drawn again (same prompts and seeds) and sampled again with
        the checkpoint's weights.
        """
        cfg, s = self.cfg, self.cfg.rl.max_staleness
        if s and cfg.rl.logprob_estimator != "tracerl":
            self.console.print(
                f"[yellow]warning[/] rl.max_staleness={s} with rl.logprob_estimator={cfg.rl.logprob_estimator}: "
                "this estimator recomputes its old log-probs under the learner's current weights, so samples up "
                f"to {s} step(s) stale are not corrected for (only 'tracerl' uses the sampler's behaviour log-probs)"
            )
        self.timeline = StageTimeline()
        self.pipeline = StepPipeline(
            self.scheduler, self.rollout_workers, self.pool, self.tasks, cfg.rl.num_generations, s,
            self.start_step, cfg.rl.steps, self.timeline, weight_sync=self.weight_sync,
            lanes=min(len(self.rollout_workers), s + 1) if self.queued_sync else 1,
        )
        self.gpu_sampler = GpuBusySampler().start()
        mode = f"asynchronous, rollout up to {s} step(s) ahead of the learner" if s else "synchronous"
        if self.pipeline.lanes > 1:
            mode += f", {self.pipeline.lanes} steps sampled side by side on their own rollout workers"
        gpus = "NVML, this node" if self.gpu_sampler.read is not None else "no GPU seen"
        self.console.print(f"[bold]pipeline[/] {mode}; GPU busy share: {gpus}")

    def _start_evaluations(self) -> dict:
        """``train_start`` and ``heldout_start``: evaluated now and kept in ``START_EVAL_FILE``, or, resuming, read
        back from there (they belong to the run's first session)."""
        path = self.run_dir / START_EVAL_FILE
        if self.resume:
            return json.loads(path.read_text()) if path.exists() else {"train_start": None, "heldout_start": None}
        start = {"train_start": self.train_eval("start"), "heldout_start": self.heldout_eval("start")}
        path.write_text(json.dumps(start, indent=1))
        return start

    def _finish(self, t_run: float, evaluations: dict) -> dict:
        records = read_metrics(self.run_dir)
        plot = plot_curves(records, self.run_dir / "curves.png", title=f"dice-ray {self.run_dir.name}")
        phases = list(dict.fromkeys(r["phase"] for r in records))  # in the order the curriculum reached them
        summary = {
            "run_dir": str(self.run_dir),
            "steps": len(records),
            "resumed_at_step": self.start_step if self.resume else None,
            "phases_seen": phases,
            "verifier_mode": records[-1]["verifier_mode"] if records else None,
            "final": {k: records[-1].get(k) for k in ("reward_mean", "compile_rate", "correct_rate", "cheat_rate", "speedup_geomean",
                                                     "verdicts")} if records else {},
            "reward_mean_first_last": [records[0]["reward_mean"], records[-1]["reward_mean"]] if records else None,
            "groups_dropped_total": sum(r["groups_dropped"] for r in records),
            **evaluations,  # train_start / train_end (reward on training prompts), heldout_start / heldout_end
            "seconds": time.perf_counter() - t_run,
            "checkpoints": self.store.url if self.store is not None else str(self.ckpt_dir),
            "metrics": str(self.run_dir / "metrics.jsonl"),
            "plot": str(plot),
            "dashboard": self.ray_info.get("dashboard"),
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        con = self.console
        con.print(Rule("summary"), width=min(con.width, 80))  # the log-file console is 160 wide: no wrapped rule
        con.print(describe_summary(summary), highlight=False)
        con.print(f"[bold]outputs[/] run directory {self.run_dir}: config.yaml, metrics.jsonl, summary.json, eval_start.json, "
                  f"curves.png, checkpoints/ (each with its policy: dice-ray eval --tasks {escape(shlex.quote(self.cfg.tasks.spec))} "
                  + ("--split heldout " if self.heldout else "")  # the tasks it did not train on
                  + f"--model {self.run_dir}); a Markdown summary and "
                  f"plots: dice-ray report {self.run_dir}")
        return summary

    def _print_decision(self, decision) -> None:
        """One line a curriculum decision (:class:`~dice_ray.cluster.scheduler.Decision`), with its figure. The target
        it sets (``infill_target``) is a share of prompts; the table's ``infill`` is the share a step drew."""
        self.console.print(f"[bold]curriculum[/] step {decision.step}: {decision.action}, infill target "
                           f"{decision.infill_fraction:.2f}: {escape(decision.reason)}", highlight=False)

    def _print_header(self) -> None:
        self.console.print(" ".join(f"{name:>{w}}" for name, w, _ in COLUMNS), style="bold")

    def _print_row(self, rec: dict) -> None:
        """One row of :data:`COLUMNS` (``infill``: the share of prompts the step drew for infilling; ``drop``: groups
        dropped), after a line naming the verifier's mode whenever it differs from the previous row's."""
        mode = rec["verifier_mode"]
        if mode != getattr(self, "_row_mode", None):
            self._row_mode = mode
            self.console.print("verifier compile-only: compile rate and dry runs, no values or times measured"
                               if mode == "compile_only" else f"verifier {mode}", style="dim", highlight=False)
        values = {
            "step": rec["step"], "phase": rec["phase"], "infill": rec["infill_fraction"], "reward": rec["reward_mean"],
            "±std": rec["reward_std"], "compile": rec["compile_rate"], "correct": rec["correct_rate"],
            "cheat": rec["cheat_rate"], "speedup": rec["speedup_geomean"], "drop": rec["groups_dropped"],
            "loss": rec["loss"], "sec": rec["step_seconds"],
        }
        cells = []
        for name, w, fmt in COLUMNS:
            v = values[name]
            cells.append(f"{'n/a' if v is None else fmt.format(v):>{w}}")
        self.console.print(" ".join(cells))

    def shutdown(self) -> None:
        sampler = getattr(self, "gpu_sampler", None)
        if sampler is not None:
            sampler.stop()
        pool = getattr(self, "pool", None)
        if pool is not None:
            try:
                ray.get(pool.close.remote(), timeout=60)
            except Exception:  # noqa: BLE001 - shutting down: the kill below still happens
                pass
        for h in [pool, getattr(self, "scheduler", None), *getattr(self, "rollout_workers", [])]:
            if h is not None:
                ray.kill(h)
        learner = getattr(self, "learner", None)
        if learner is not None:  # a driver that runs several trainers (benchmarks/learning.py) frees their CPUs / GPUs
            learner.shutdown()


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """``state.json`` of the newest complete checkpoint under ``ckpt_dir``, or None."""
    if not ckpt_dir.is_dir():
        return None
    states = sorted(ckpt_dir.glob("step_*/state.json"))
    return states[-1] if states else None


def newest_checkpoint_tag(store: CheckpointStore | None, ckpt_dir: Path) -> str | None:
    """Tag (``step_NNNNNN``, NNNNNN steps done) of a run's newest complete checkpoint: in ``store`` for a run with
    ``storage_path``, else under ``ckpt_dir``; None when there is none."""
    if store is not None:
        return store.latest()
    state = latest_checkpoint(ckpt_dir)
    return state.parent.name if state is not None else None


@contextmanager
def waiting(console: Console, what: str) -> Iterator[None]:
    """Say what the run waits for: a spinner with ``what`` on a terminal; elsewhere (a log, ``ray job logs``) the
    line ``what ...`` once, so a log does not go silent while actors start (~10-20 s on a 2-core machine)."""
    if console.is_terminal:
        with console.status(what):
            yield
    else:
        console.print(f"{what} ...")
        yield


#: the start evaluations of a run (training prompts, held-out tasks), kept for the summary of a resumed run
START_EVAL_FILE = "eval_start.json"

#: what a folder holds once a run used it (a second run there would append to its metrics, overwrite its config and
#: rotate its checkpoints away)
RUN_FILES = ("config.yaml", "metrics.jsonl", "checkpoints")


def new_run_dir(cfg: DiceConfig) -> Path:
    """``cfg.run_dir / (run_name or a timestamp)``: a folder no run has used.  A timestamp another run took (two
    runs started in the same second) gets ``-2``, ``-3``, ...

    Raises:
        ValueError: ``run_name`` names a folder that holds a run (:data:`RUN_FILES`); the message gives the
            ``--resume`` command that continues it.
    """
    root = Path(cfg.run_dir).expanduser().resolve()
    if cfg.run_name:
        path = root / cfg.run_name
        used = [f for f in RUN_FILES if (path / f).exists()]
        if used:
            raise ValueError(f"run_name={cfg.run_name}: {path} already holds a run ({', '.join(used)}); "
                             f"`dice-ray train --resume {path}` continues it, another run_name starts a new one")
        return path
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    path, n = root / stamp, 2
    while path.exists():
        path, n = root / f"{stamp}-{n}", n + 1
    return path


#: config sections a resume cannot change: the checkpoint's policy (family, shape, weights) and the task list whose
#: order and split the phase scheduler's saved position indexes
RESUME_FIXED = ("model", "tasks")


def resume_config(run_dir: Path, overrides: list[str]) -> DiceConfig:
    """The config of ``dice-ray train --resume RUN_DIR key=value ...``: the run's ``config.yaml`` with the overrides,
    checked against the run before anything is started or written.

    Raises:
        FileNotFoundError: ``run_dir`` has no ``config.yaml`` (not a dice-ray run directory).
        pydantic.ValidationError / ValueError: a bad key or value; an override of a :data:`RESUME_FIXED` section
            (naming the field, its value in the run and the one asked for); ``rl.steps`` not above the steps the
            run's newest checkpoint holds (nothing to do).
    """
    cfg_file = run_dir / "config.yaml"
    if not cfg_file.exists():
        raise FileNotFoundError(f"--resume {run_dir}: no config.yaml (not a dice-ray run directory)")
    saved, cfg = load_config(cfg_file, []), load_config(cfg_file, overrides)
    for section in RESUME_FIXED:
        was, now = getattr(saved, section).model_dump(), getattr(cfg, section).model_dump()
        changed = [k for k in now if now[k] != was.get(k)]
        if changed:
            k = changed[0]
            raise ValueError(f"--resume {run_dir}: {section}.{k} cannot change on resume (the run has {was.get(k)!r}, "
                             f"asked {now[k]!r}): the checkpoint's policy and the scheduler's task position depend on "
                             f"the {section} section; start a new run for another")
    store = CheckpointStore(run_store_url(cfg.storage_path, run_dir.name)) if cfg.storage_path else None
    tag = newest_checkpoint_tag(store, run_dir / "checkpoints")
    done = int(tag.removeprefix("step_")) if tag and tag.removeprefix("step_").isdigit() else None
    if done is not None and cfg.rl.steps <= done:
        raise ValueError(f"--resume {run_dir}: rl.steps={cfg.rl.steps}, and its newest checkpoint ({tag}) already holds "
                         f"{done} steps: nothing to do; pass rl.steps={done + 1} or more to train longer")
    return cfg


def train(config_path: str | None, overrides: list[str], resume: str | None, console: Console | None = None) -> dict:
    """Entry point of ``dice-ray train`` and ``jobs/train.py``.

    Raises:
        KeyboardInterrupt: Ctrl-C (after printing how many steps were done and the ``--resume`` command).
        pydantic.ValidationError / ValueError: a bad config key or value (before any actor starts).
        ValueError: ``--resume`` with an override of the ``model`` or ``tasks`` section, or with ``rl.steps`` not
            above the steps already done (:func:`resume_config`; before anything starts or is written).
        FileNotFoundError / ValueError: ``--resume`` names a folder with no config or checkpoint, or ``model.path``
            is not a policy or checkpoint folder with the files it needs nor a hub id that can be had
            (:meth:`DiffusionPolicy.check_path`, before anything starts), or ``tasks.spec``'s path gives
            no data file (before the run folder or Ray is started).
        ValueError: ``tasks.spec`` is malformed or no task of it is accepted (before the run folder or Ray
            is started; the message counts the rejections by rule).
        ValueError: ``run_name`` names a folder that holds a run (:func:`new_run_dir`).
    """
    if resume:
        run_dir = Path(resume).expanduser().resolve()
        cfg = resume_config(run_dir, overrides)
    else:
        cfg = load_config(config_path, overrides)
        run_dir = new_run_dir(cfg)
    if cfg.model.path:  # a broken folder or an unreachable hub id fails here, not in every actor (the cache is filled)
        from dice_ray.policy.policy import DiffusionPolicy

        DiffusionPolicy.check_path(cfg.model.path, cfg.model)
    trainer = Trainer(cfg, run_dir, resume=bool(resume), console=console)
    try:
        return trainer.run()
    except KeyboardInterrupt:
        _calm_further_interrupts(trainer.console)
        done = mark_stopped(run_dir, "interrupted", cfg.rl.steps)
        trainer.console.print(f"[bold]stopped[/] (interrupted) with {done} of {cfg.rl.steps} steps done; "
                              f"continue from the last checkpoint: dice-ray train --resume {run_dir}")
        raise
    except Exception as e:
        mark_stopped(run_dir, error_line(e), cfg.rl.steps)
        raise
    finally:
        trainer.shutdown()


def _calm_further_interrupts(console: Console) -> None:
    """After the first Ctrl-C, another one (while the actors and the local Ray cluster shut down, seconds) only
    says that the run is stopping: raised inside Ray's own shutdown, and again in its exit handler, it printed
    tracebacks (a fresh user's trial, stop 38).  Main thread only (signals are set there)."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, lambda *_: console.print("stopping: the actors and Ray are shutting down "
                                                              "(Ctrl-\\ kills at once)"))


def mark_stopped(run_dir: Path, reason: str, steps: int) -> int:
    """Write ``run_dir/stopped.json`` (:data:`~dice_ray.report.STOPPED_FILE`, read by ``dice-ray report``): the
    session ended early for ``reason`` (``interrupted``, or the error's line). Returns the steps done (records of
    ``metrics.jsonl``). Nothing is written where the run folder was never made (set-up failed before it)."""
    if not run_dir.is_dir():
        return 0
    done = len(read_metrics(run_dir)) if (run_dir / "metrics.jsonl").is_file() else 0
    (run_dir / STOPPED_FILE).write_text(json.dumps({"reason": reason, "steps_done": done, "steps": steps,
                                                    "time": time.time()}, indent=1))
    return done

