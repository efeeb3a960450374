"""The driver loop of ``dice-ray train``: DICE's bi-phase RL (BiC-RL) on a Ray cluster.

Each step reads like the algorithm (slime's ``train.py`` shape): the phase scheduler picks prompts,
rollout workers sample groups, the verifier pool gives one verdict a candidate, the learner takes a
GRPO-family step on group advantages, the new weights reach the rollout workers, and the step is
recorded, exported and checkpointed.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import statistics
import time
from datetime import datetime
from pathlib import Path

import ray
import torch
import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dice_ray.cluster.learner import Learner, TrainGroup, learner_env, make_train_group
from dice_ray.cluster.metrics import RunMetrics
from dice_ray.cluster.rollout import GroupRollout, RolloutWorker
from dice_ray.cluster.scheduler import NAMESPACE, SCHEDULER_NAME, PhaseSchedulerActor
from dice_ray.cluster.storage import CheckpointStore, run_store_url
from dice_ray.cluster.verifier_pool import POOL_NAME, VerifierPool
from dice_ray.config import DiceConfig, load_config
from dice_ray.report import plot_curves, read_metrics
from dice_ray.rl.advantages import group_advantages
from dice_ray.tasks.loaders import load_tasks
from dice_ray.tasks.prompts import can_infill
from dice_ray.tasks.task import Task
from dice_ray.verify.verifier import AUTO_GPU_WORKERS

COLUMNS = [
    ("step", 4, "{:d}"), ("phase", 6, "{}"), ("inf.frac", 8, "{:.2f}"), ("reward", 6, "{:.3f}"), ("±std", 6, "{:.3f}"),
    ("compile", 7, "{:.0%}"), ("correct", 7, "{:.0%}"), ("cheat", 6, "{:.0%}"), ("speedup", 7, "{:.2f}x"),
    ("dropped", 7, "{:d}"), ("loss", 9, "{:+.2e}"), ("sec", 6, "{:.1f}"), ("mode", 12, "{}"),
]


def start_ray(address: str | None) -> dict:
    """Connect to ``address`` (or ``RAY_ADDRESS``), or start a local cluster with the dashboard.

    Returns:
        ``{"address": ..., "dashboard": url or None, "started": bool}``.
    """
    address = address or os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():
        ctx = ray.get_runtime_context()
        return {"address": ctx.gcs_address, "dashboard": None, "started": False}
    if address:
        ctx = ray.init(address=address, namespace=NAMESPACE, log_to_driver=True)
        started = False
    else:
        ctx = ray.init(namespace=NAMESPACE, include_dashboard=True, dashboard_host="127.0.0.1", log_to_driver=True)
        started = True
    url = ctx.dashboard_url
    return {"address": ctx.address_info.get("gcs_address"), "dashboard": f"http://{url}" if url else None, "started": started}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def split_tasks(tasks: list[Task], cfg: DiceConfig) -> tuple[list[Task], list[Task]]:
    """Deterministic train / held-out split: every k-th task of each level is held out."""
    if cfg.tasks.heldout_fraction <= 0 or len(tasks) < 2:
        return tasks, []
    k = max(2, round(1 / cfg.tasks.heldout_fraction))
    ordered = sorted(tasks, key=lambda t: (t.level, t.task_id))
    heldout = [t for i, t in enumerate(ordered) if i % k == k - 1]
    held = {t.task_id for t in heldout}
    return [t for t in ordered if t.task_id not in held], heldout


def step_record(step: int, phase: str, frac: float, groups: list[GroupRollout], verdicts: list, dropped: int) -> dict:
    """Per-step figures from verdicts: reward mean/std, compile / correct / cheat rates, speedup geomean."""
    rewards = [v.reward for v in verdicts]
    n = max(len(verdicts), 1)
    measured = [v for v in verdicts if v.correct is not None]
    speedups = [v.speedup for v in verdicts if v.correct and v.speedup and v.speedup > 0]
    counts: dict[str, int] = {}
    for v in verdicts:
        counts[v.verdict] = counts.get(v.verdict, 0) + 1
    return {
        "step": step,
        "phase": phase,
        "infill_fraction": frac,
        "reward_mean": statistics.fmean(rewards) if rewards else 0.0,
        "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "compile_rate": sum(v.compiled for v in verdicts) / n,
        "correct_rate": (sum(bool(v.correct) for v in measured) / len(measured)) if measured else None,
        "cheat_rate": counts.get("cheat", 0) / n,
        "speedup_geomean": math.exp(statistics.fmean(math.log(s) for s in speedups)) if speedups else None,
        "verdicts": counts,
        "candidates": len(verdicts),
        "groups": len(groups),
        "groups_dropped": dropped,
        "verifier_mode": verdicts[0].mode if verdicts else None,
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
        self.console = console or Console(width=None if Console().is_terminal else 132)
        self.ckpt_dir = self.run_dir / "checkpoints"  # the checkpoints, or their staging folder with storage_path
        self.store = CheckpointStore(run_store_url(cfg.storage_path, self.run_dir.name)) if cfg.storage_path else None
        self.start_step = 0
        self.weights_version = 0

    # ---- set-up -------------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg, con = self.cfg, self.console
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        self.ray_info = start_ray(cfg.cluster.address)
        con.print(f"[bold]ray[/] {self.ray_info['address']}  dashboard: {self.ray_info['dashboard']}")
        report = load_tasks(cfg.tasks.spec, max_input_elements=cfg.tasks.max_input_elements)
        con.print(f"[bold]tasks[/] {report.summary()}")
        tasks = report.tasks[: cfg.tasks.max_tasks] if cfg.tasks.max_tasks else report.tasks
        if not tasks:
            raise ValueError(f"tasks.spec={cfg.tasks.spec!r}: no task accepted")
        self.train_tasks, self.heldout = split_tasks(tasks, cfg)
        self.tasks = {t.task_id: t for t in tasks}
        con.print(f"[bold]split[/] {len(self.train_tasks)} training tasks, {len(self.heldout)} held out")

        gpus = int(ray.cluster_resources().get("GPU", 0))
        self.metrics = RunMetrics(self.run_dir.name)
        self.scheduler = PhaseSchedulerActor.options(name=SCHEDULER_NAME, namespace=NAMESPACE).remote(
            [(t.task_id, t.level, t.solution_format == "fast" and can_infill(t, cfg.phase.scaffold_granularity))
             for t in self.train_tasks], cfg.phase, cfg.rl.prompts_per_step, cfg.rl.seed
        )
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
            RolloutWorker.options(num_gpus=cfg.cluster.rollout_gpus if gpus else 0).remote(
                cfg.model, cfg.sampling, self.tasks, cfg.tasks.prompt_template, threads, cfg.phase.scaffold_granularity
            )
            for _ in range(cfg.cluster.num_rollout_workers)
        ]
        use_gpu = bool(gpus and cfg.cluster.learner_gpus)
        self.learner = Learner.options(
            num_gpus=cfg.cluster.learner_gpus if use_gpu else 0, runtime_env={"env_vars": learner_env(use_gpu)}
        ).remote(cfg, 0, 1, "127.0.0.1", _free_port(), threads)
        con.print(
            f"[bold]actors[/] scheduler, {len(self.rollout_workers)} rollout worker(s), "
            f"{n_verifiers} verifier(s) ({'GPU' if gpus_per_verifier else 'CPU, compile-only'}), "
            f"learner ({'GPU, NCCL' if use_gpu else 'CPU, gloo'}, ZeRO-{cfg.cluster.zero_stage})"
        )
        ray.get(self.pool.status.remote())

        if self.resume:
            self._restore()
        else:
            self._warm_start()
            con.print(f"[bold]learner[/] {ray.get(self.learner.init_engine.remote())}")
        self._sync_weights()

    def _warm_start(self) -> None:
        """Masked-diffusion SFT of the learner's policy on the training tasks' reference solutions."""
        from dice_ray.tasks.prompts import sft_pairs

        cfg, con = self.cfg, self.console
        if not cfg.sft.enabled or cfg.model.path:
            return
        pairs = [p for t in self.train_tasks if t.solution_src for p in sft_pairs(t, cfg.tasks.prompt_template)]
        if not pairs:
            con.print("[bold]warm start[/] skipped: no training task has a reference solution to learn from")
            return
        with con.status(f"warm start: masked-diffusion SFT on {len(pairs)} pairs (cached after the first run)"):
            report = ray.get(self.learner.warm_start.remote(pairs))
        losses = report.pop("losses", [])
        con.print(f"[bold]warm start[/] {report} (loss {losses[0][1]:.2f} -> {losses[-1][1]:.3f})" if losses else f"[bold]warm start[/] {report}")

    def _restore(self) -> None:
        if self.store is not None:
            tag = self.store.latest()
            if tag is None:
                raise FileNotFoundError(f"--resume {self.run_dir}: no complete checkpoint under {self.store.url}")
            state_path = self.store.fetch(tag, self.ckpt_dir) / "state.json"
            self.console.print(f"[bold]storage[/] fetched {tag} from {self.store.url}")
        else:
            state_path = latest_checkpoint(self.ckpt_dir)
        if state_path is None:
            raise FileNotFoundError(f"--resume {self.run_dir}: no checkpoint under {self.ckpt_dir}")
        state = json.loads(state_path.read_text())
        self.console.print(f"[bold]learner[/] {ray.get(self.learner.init_engine.remote())}")
        ray.get(self.learner.load.remote(str(self.ckpt_dir), state_path.parent.name))
        ray.get(self.scheduler.set_state.remote(state["schedule"]))
        self.start_step = state["step"]
        self.weights_version = state["step"]
        metrics = self.run_dir / "metrics.jsonl"
        if metrics.exists():
            kept = [r for r in read_metrics(self.run_dir) if r["step"] < self.start_step]
            metrics.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self.console.print(f"[bold]resumed[/] from {state_path.parent} at step {self.start_step} ({state['schedule']})")

    # ---- one RL step, stage by stage -----------------------------------------------------------------
    def rollout(self, requests: list) -> list[GroupRollout]:
        n = len(self.rollout_workers)
        shards = [requests[i::n] for i in range(n)]
        refs = [w.generate.remote(s, self.cfg.rl.num_generations) for w, s in zip(self.rollout_workers, shards) if s]
        groups = [g for part in ray.get(refs) for g in part]
        stale = [g.request.request_id for g in groups if g.weights_version != self.weights_version]
        if stale:
            raise RuntimeError(f"rollouts {stale} sampled with stale weights (want version {self.weights_version})")
        return groups

    def verify(self, groups: list[GroupRollout]) -> list:
        items = [
            (f"{g.request.request_id}-g{j}", self.tasks[g.request.task_id], src)
            for g in groups
            for j, src in enumerate(g.candidates)
        ]
        return ray.get(self.pool.verify_batch.remote(items))

    def learn(self, groups: list[GroupRollout], verdicts: list) -> tuple[dict | None, int]:
        g = self.cfg.rl.num_generations
        rewards = torch.tensor([v.reward for v in verdicts], dtype=torch.float32).view(len(groups), g)
        adv = group_advantages(rewards, scale_rewards=self.cfg.rl.scale_rewards)
        batch: list[TrainGroup] = [
            make_train_group(grp.rollouts[0].prompt_ids, grp.rollouts, adv.advantages[i])
            for i, grp in enumerate(groups)
            if adv.keep[i]
        ]
        if not batch:
            return None, adv.num_dropped
        return ray.get(self.learner.train_step.remote(batch)), adv.num_dropped

    def _sync_weights(self) -> float:
        t0 = time.perf_counter()
        weights = self.learner.get_weights.remote()
        ray.get([w.set_weights.remote(weights, self.weights_version) for w in self.rollout_workers])
        return time.perf_counter() - t0

    def checkpoint(self, step: int) -> None:
        tag = f"step_{step:06d}"
        ray.get(self.learner.save.remote(str(self.ckpt_dir), tag))
        state = {"step": step, "schedule": ray.get(self.scheduler.get_state.remote()), "time": time.time()}
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

        Args:
            show: called with a short status line as each stage starts.

        Returns:
            the step's record (figures of :func:`step_record` plus stage timings and learner stats).
        """
        t0 = time.perf_counter()
        step, frac, phase, requests = ray.get(self.scheduler.next_batch.remote())
        show(f"step {step} {phase}: rollout")
        groups = self.rollout(requests)
        t_roll = time.perf_counter()
        show(f"step {step} {phase}: verify {sum(len(g.candidates) for g in groups)}")
        verdicts = self.verify(groups)
        t_ver = time.perf_counter()
        show(f"step {step} {phase}: learn")
        learned, dropped = self.learn(groups, verdicts)
        t_learn = time.perf_counter()
        self.weights_version = step + 1
        sync_s = self._sync_weights()
        rec = step_record(step, phase, frac, groups, verdicts, dropped)
        pool = ray.get(self.pool.status.remote())
        learned = learned or {}
        rec.update(
            loss=learned.get("loss"), clip_fraction=learned.get("clip_fraction"), kl=learned.get("kl"),
            ratio_mean=learned.get("ratio_mean"), grad_norm=learned.get("grad_norm"), learner_tokens=learned.get("tokens", 0),
            learner_step_seconds=learned.get("seconds", 0.0),
            rollout_seconds=t_roll - t0, verify_seconds=t_ver - t_roll, learn_seconds=t_learn - t_ver, sync_seconds=sync_s,
            rollout_tokens_per_s=sum(g.tokens for g in groups) / max(t_roll - t0, 1e-9),
            verifier_throughput=len(verdicts) / max(t_ver - t_roll, 1e-9),
            verifier_queue_depth=pool["queue_depth"], verifier_pool_size=pool["size"],
            weights_version=self.weights_version,
        )
        if (step + 1) % self.cfg.checkpoint_every == 0 or step + 1 == self.cfg.rl.steps:
            self.checkpoint(step + 1)
        rec["step_seconds"] = time.perf_counter() - t0
        return rec

    def record(self, rec: dict) -> None:
        """Append the step to metrics.jsonl, export it to Ray metrics and the scheduler, print its row."""
        with (self.run_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(rec) + "\n")
        self.metrics.publish(rec)
        self.scheduler.report.remote(rec)
        self._print_row(rec)

    # ---- held-out report -----------------------------------------------------------------------------
    def heldout_eval(self, when: str) -> dict | None:
        """Compile (and, on GPUs, correct) rates of samples on held-out tasks, per phase."""
        from dice_ray.cluster.scheduler import PromptRequest

        tasks = self.heldout[: self.cfg.eval.heldout_tasks]
        if not tasks:
            return None
        out = {}
        for phase in ("infill", "e2e"):
            eligible = [t for t in tasks if phase == "e2e" or t.solution_format == "fast"]
            if not eligible:
                continue
            reqs = [PromptRequest(f"eval-{when}-{phase}-{i}", t.task_id, phase, 7919 + i) for i, t in enumerate(eligible)]
            n = len(self.rollout_workers)
            refs = [w.generate.remote(reqs[i::n], self.cfg.eval.samples) for i, w in enumerate(self.rollout_workers) if reqs[i::n]]
            groups = [g for part in ray.get(refs) for g in part]
            verdicts = self.verify(groups)
            measured = [v for v in verdicts if v.correct is not None]
            out[phase] = {
                "candidates": len(verdicts),
                "compile_rate": sum(v.compiled for v in verdicts) / max(len(verdicts), 1),
                "correct_rate": (sum(bool(v.correct) for v in measured) / len(measured)) if measured else None,
            }
        self.console.print(f"[bold]held-out ({when})[/] {out}")
        return out

    # ---- the loop --------------------------------------------------------------------------------------
    def run(self) -> dict:
        """Run set-up, the RL steps and the final report; returns the summary (also in summary.json)."""
        cfg, con = self.cfg, self.console
        t_run = time.perf_counter()
        self.setup()
        heldout_start = self._previous_summary().get("heldout_start") if self.resume else self.heldout_eval("start")
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
        heldout_end = self.heldout_eval("end")
        return self._finish(t_run, heldout_start, heldout_end)

    def _previous_summary(self) -> dict:
        path = self.run_dir / "summary.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def _finish(self, t_run: float, heldout_start: dict | None, heldout_end: dict | None) -> dict:
        records = read_metrics(self.run_dir)
        plot = plot_curves(records, self.run_dir / "curves.png", title=f"dice-ray {self.run_dir.name}")
        phases = sorted({r["phase"] for r in records})
        summary = {
            "run_dir": str(self.run_dir),
            "steps": len(records),
            "phases_seen": phases,
            "verifier_mode": records[-1]["verifier_mode"] if records else None,
            "final": {k: records[-1].get(k) for k in ("reward_mean", "compile_rate", "correct_rate", "cheat_rate", "speedup_geomean")} if records else {},
            "reward_mean_first_last": [records[0]["reward_mean"], records[-1]["reward_mean"]] if records else None,
            "groups_dropped_total": sum(r["groups_dropped"] for r in records),
            "heldout_start": heldout_start,
            "heldout_end": heldout_end,
            "seconds": time.perf_counter() - t_run,
            "checkpoints": self.store.url if self.store is not None else str(self.ckpt_dir),
            "metrics": str(self.run_dir / "metrics.jsonl"),
            "plot": str(plot),
            "dashboard": self.ray_info.get("dashboard"),
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        con = self.console
        con.rule("summary")
        con.print_json(json.dumps(summary))
        con.print(f"[bold]outputs[/] run directory {self.run_dir}: config.yaml, metrics.jsonl, summary.json, curves.png, checkpoints/")
        return summary

    def _print_header(self) -> None:
        self.console.print(" ".join(f"{name:>{w}}" for name, w, _ in COLUMNS), style="bold")

    def _print_row(self, rec: dict) -> None:
        values = {
            "step": rec["step"], "phase": rec["phase"], "inf.frac": rec["infill_fraction"], "reward": rec["reward_mean"],
            "±std": rec["reward_std"], "compile": rec["compile_rate"], "correct": rec["correct_rate"],
            "cheat": rec["cheat_rate"], "speedup": rec["speedup_geomean"], "dropped": rec["groups_dropped"],
            "loss": rec["loss"], "sec": rec["step_seconds"],
            "mode": "compile-only" if rec["verifier_mode"] == "compile_only" else "gpu",
        }
        cells = []
        for name, w, fmt in COLUMNS:
            v = values[name]
            cells.append(f"{'n/a' if v is None else fmt.format(v):>{w}}")
        self.console.print(" ".join(cells))

    def shutdown(self) -> None:
        pool = getattr(self, "pool", None)
        if pool is not None:
            try:
                ray.get(pool.close.remote(), timeout=60)
            except Exception:  # noqa: BLE001 - shutting down: the kill below still happens
                pass
        for h in [pool, getattr(self, "scheduler", None)]:
            if h is not None:
                ray.kill(h)


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """``state.json`` of the newest complete checkpoint under ``ckpt_dir``, or None."""
    if not ckpt_dir.is_dir():
        return None
    states = sorted(ckpt_dir.glob("step_*/state.json"))
    return states[-1] if states else None


def new_run_dir(cfg: DiceConfig) -> Path:
    """``cfg.run_dir / (run_name or a timestamp)``."""
    name = cfg.run_name or datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path(cfg.run_dir).expanduser().resolve() / name


def train(config_path: str | None, overrides: list[str], resume: str | None, console: Console | None = None) -> dict:
    """Entry point of ``dice-ray train`` and ``jobs/train.py``.

    Raises:
        pydantic.ValidationError / ValueError: a bad config key or value (before any actor starts).
        FileNotFoundError: ``--resume`` names a folder with no config or checkpoint.
    """
    if resume:
        run_dir = Path(resume).expanduser().resolve()
        cfg_file = run_dir / "config.yaml"
        if not cfg_file.exists():
            raise FileNotFoundError(f"--resume {run_dir}: no config.yaml (not a dice-ray run directory)")
        cfg = load_config(cfg_file, overrides)
    else:
        cfg = load_config(config_path, overrides)
        run_dir = new_run_dir(cfg)
    trainer = Trainer(cfg, run_dir, resume=bool(resume), console=console)
    try:
        return trainer.run()
    finally:
        trainer.shutdown()

