"""The driver loop of ``dice-ray train``: DICE's bi-phase RL (BiC-RL) on a Ray cluster.

Each step reads like the algorithm (slime's ``train.py`` shape): the phase scheduler picks prompts,
rollout workers sample groups, the verifier pool gives one verdict a candidate, the learner takes a
GRPO-family step on group advantages, the new weights reach the rollout workers, and the step is
recorded, exported and checkpointed. With ``rl.max_staleness > 0`` the rollouts and verification of
the next steps run while the learner trains (:class:`~dice_ray.cluster.pipeline.StepPipeline`); each
step records its stage timings, busy shares and sample staleness (:mod:`dice_ray.cluster.metrics`).

:class:`Trainer` owns the run's actors and the loop (:meth:`Trainer.run`, :meth:`Trainer.train_step`); :func:`train`
is the command. Around them: Ray's start (:mod:`~dice_ray.cluster.ray_start`), the console's lines
(:mod:`~dice_ray.cluster.console`), a step's record (:mod:`~dice_ray.cluster.step_record`), the start and end
evaluations (:mod:`~dice_ray.cluster.evaluation`), checkpoints and the resume's choice of one
(:mod:`~dice_ray.cluster.checkpoint`), and the run folder (:mod:`~dice_ray.cluster.run_folder`).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections import Counter
from pathlib import Path

import ray
import torch
import yaml
from rich.console import Console
from rich.markup import escape
from rich.rule import Rule
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dice_ray.cluster.checkpoint import resume_point, save_checkpoint
from dice_ray.cluster.console import StepTable, describe_learner, describe_outputs, describe_summary, describe_warm_start, waiting
from dice_ray.cluster.errors import error_line
from dice_ray.cluster.evaluation import Evaluations
from dice_ray.cluster.learner import LearnerGroup, TrainGroup, learner_env, make_train_group
from dice_ray.cluster.metrics import GpuBusySampler, RunMetrics, StageTimeline
from dice_ray.cluster.pipeline import Flight, StepPipeline, staleness_stats
from dice_ray.cluster.ray_start import start_ray
from dice_ray.cluster.rollout import ROLLOUT_MAX_RESTARTS, GroupRollout, RolloutWorker
from dice_ray.cluster.run_folder import mark_stopped, new_run_dir, resume_config
from dice_ray.cluster.scheduler import NAMESPACE, SCHEDULER_NAME, PhaseSchedulerActor
from dice_ray.cluster.step_record import step_record
from dice_ray.cluster.storage import CheckpointStore, run_store_url
from dice_ray.cluster.verifier_pool import POOL_NAME, VerifierPool
from dice_ray.cluster.weight_sync import WeightSync, resolve_mode
from dice_ray.config import DiceConfig, load_config
from dice_ray.report import STOPPED_FILE, plot_curves, read_metrics
from dice_ray.rl.advantages import group_advantages
from dice_ray.tasks.loaders import load_tasks, phase_pool, select_tasks, split_tasks
from dice_ray.tasks.prompts import infill_blocker
from dice_ray.verify.verifier import AUTO_GPU_WORKERS


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
        self.table = StepTable(self.console)

    # ---- the loop --------------------------------------------------------------------------------
    def run(self) -> dict:
        """Run set-up, the RL steps and the final report; returns the summary (also in summary.json)."""
        cfg, con = self.cfg, self.console
        t_run = time.perf_counter()
        self.setup()
        start = self.evals.at_start(self.run_dir, self.resume)
        self._start_pipeline()
        self.table.header()
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
        return self._finish(t_run, {**start, **self.evals.at_end()})

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
            self.table.decision(batch.plan.decision)
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
        """Save the learner and the scheduler state as ``step_{step:06d}``, copied to ``storage_path`` when set
        (:func:`~dice_ray.cluster.checkpoint.save_checkpoint`; ``schedule``: the state to save instead of the
        scheduler's own, when batches were drawn ahead of the learner)."""
        save_checkpoint(self.learner, self.scheduler, self.ckpt_dir, self.store, self.cfg.keep_checkpoints, step, schedule)

    def record(self, rec: dict) -> None:
        """Append the step to metrics.jsonl, export it to Ray metrics, print its row, and post the finished record
        (its times too) to the scheduler for ``dice-ray status`` (:meth:`train_step` posted its figures for the
        curriculum before the checkpoint)."""
        self.scheduler.report.remote(rec)
        with (self.run_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(rec) + "\n")
        self.metrics.publish(rec)
        self.table.row(rec)

    # ---- set-up (before the first step) ----------------------------------------------------------
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
        self.evals = Evaluations(cfg, con, self.rollout_workers, self.pool, self.tasks, self.pools, self.heldout, self.unfit)
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
        """Load the newest checkpoint of storage and the local folder (:func:`~dice_ray.cluster.checkpoint.resume_point`,
        named on the console with where it came from) into the learner and the scheduler, and drop the metrics of
        the steps after it."""
        point = resume_point(self.store, self.ckpt_dir, self.run_dir)
        if self.store is not None:  # which of the two places, and why
            self.console.print(point.line)
        state_path, state = point.state_path, point.state
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

    # ---- the end ---------------------------------------------------------------------------------
    def _finish(self, t_run: float, evaluations: dict) -> dict:
        """The run's summary (``summary.json``, returned) from its metrics and ``evaluations``; the curves' plot, and
        the summary's lines and the outputs line on the console."""
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
        con.print(describe_outputs(self.run_dir, self.cfg.tasks.spec, bool(self.heldout)))
        return summary

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


def train(config_path: str | None, overrides: list[str], resume: str | None, console: Console | None = None) -> dict:
    """Entry point of ``dice-ray train`` and ``jobs/train.py``.

    Raises:
        KeyboardInterrupt: Ctrl-C (after printing how many steps were done and the ``--resume`` command).
        pydantic.ValidationError / ValueError: a bad config key or value (before any actor starts).
        ValueError: ``--resume`` with an override of the ``model`` or ``tasks`` section, or with ``rl.steps`` not
            above the steps already done (:func:`~dice_ray.cluster.run_folder.resume_config`; before anything starts or
            is written).
        FileNotFoundError / ValueError: ``--resume`` names a folder with no config or checkpoint, or ``model.path``
            is not a policy or checkpoint folder with the files it needs nor a hub id that can be had
            (:meth:`DiffusionPolicy.check_path`, before anything starts), or ``tasks.spec``'s path gives
            no data file (before the run folder or Ray is started).
        ValueError: ``tasks.spec`` is malformed or no task of it is accepted (before the run folder or Ray
            is started; the message counts the rejections by rule).
        ValueError: ``run_name`` names a folder that holds a run (:func:`~dice_ray.cluster.run_folder.new_run_dir`).
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

