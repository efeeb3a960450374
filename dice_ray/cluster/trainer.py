"""The driver loop of ``dice-ray train``: DICE's bi-phase RL (BiC-RL) on a Ray cluster.

Each step reads like the algorithm (slime's ``train.py`` shape): the phase scheduler picks prompts,
rollout workers sample groups, the verifier pool gives one verdict a candidate, the learner takes a
GRPO-family step on group advantages, the new weights reach the rollout workers, and the step is
recorded, exported and checkpointed. With ``rl.max_staleness > 0`` the rollouts and verification of
the next steps run while the learner trains (:class:`~dice_ray.cluster.pipeline.StepPipeline`); each
step records its stage timings, busy shares and sample staleness (:mod:`dice_ray.cluster.metrics`).

:class:`Trainer` owns the run's actors and the loop (:meth:`Trainer.run`, :meth:`Trainer.train_step`); :func:`train`
is the command. Around them: the set-up before the first step (:mod:`~dice_ray.cluster.run_setup`), Ray's start
(:mod:`~dice_ray.cluster.ray_start`), the console's lines (:mod:`~dice_ray.cluster.console`), a step's record
(:mod:`~dice_ray.cluster.step_record`), the start and end evaluations (:mod:`~dice_ray.cluster.evaluation`),
checkpoints and the resume's choice of one (:mod:`~dice_ray.cluster.checkpoint`), and the run folder
(:mod:`~dice_ray.cluster.run_folder`).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import ray
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.rule import Rule

from dice_ray.cluster.checkpoint import save_checkpoint
from dice_ray.cluster.console import StepTable, describe_outputs, describe_summary
from dice_ray.cluster.errors import error_line
from dice_ray.cluster.learner import TrainGroup, make_train_group
from dice_ray.cluster.pipeline import Flight, staleness_stats
from dice_ray.cluster.rollout import GroupRollout
from dice_ray.cluster.run_folder import mark_stopped, new_run_dir, resume_config
from dice_ray.cluster.run_setup import RunSetup
from dice_ray.cluster.step_record import step_record
from dice_ray.cluster.storage import CheckpointStore, run_store_url
from dice_ray.config import DiceConfig, load_config
from dice_ray.report import plot_curves, read_metrics
from dice_ray.rl.advantages import group_advantages


class Trainer(RunSetup):
    """Owns one run: its Ray actors (started by :meth:`~dice_ray.cluster.run_setup.RunSetup.setup`), its run directory
    and the loop.

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
        sync = self._sync_weights(wait=not self.queued_sync, changed=flight is not None)
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
        dropped = adv.num_dropped if self.cfg.rl.drop_flat_groups else 0
        batch: list[TrainGroup] = [
            make_train_group(grp.rollouts[0].prompt_ids, grp.rollouts, adv.advantages[i])
            for i, grp in enumerate(groups)
            if adv.keep[i] or not self.cfg.rl.drop_flat_groups
        ]
        if not batch or not self.cfg.rl.update_policy:  # nothing to learn from, or the control arm: no update
            return None, dropped
        return self.pipeline.submit("learn", [self.learner.train_step.remote(batch)], start=t0), dropped

    def _sync_weights(self, wait: bool = True, changed: bool = True) -> dict:
        """Push the learner's weights to the rollout workers (:class:`WeightSync`); returns :meth:`WeightSync.push`'s
        report (``seconds``, ``restarts``: workers found restarted and re-sent the weights). ``wait=False``:
        queued behind the rollouts launched ahead, not waited for (object store only). ``changed=False`` (the step
        made no update): the workers only relabel what they hold (:meth:`WeightSync.relabel`)."""
        sync = self.weight_sync.push if changed else self.weight_sync.relabel
        return sync(self.weights_version, wait=wait)

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
        """Stop the run's actors (the verifier pool closed first: its slots' placement groups go with it), then remove
        the learner's and rollout workers' placement groups; safe after a set-up that stopped half-way."""
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
        for placement in (getattr(self, "rollout_placement", None), getattr(self, "learner_placement", None)):
            if placement is not None:
                placement.remove()


def train(config_path: str | None, overrides: list[str], resume: str | None, console: Console | None = None) -> dict:
    """Entry point of ``dice-ray train`` and ``jobs/train.py``.

    Raises:
        KeyboardInterrupt: Ctrl-C, or :class:`Terminated` on SIGTERM (after printing how many steps were done and the
            ``--resume`` command).
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
    previous = _stop_on_sigterm()
    try:
        return trainer.run()
    except KeyboardInterrupt as e:
        _calm_further_interrupts(trainer.console)
        why = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"
        done = mark_stopped(run_dir, why, cfg.rl.steps)
        trainer.console.print(f"[bold]stopped[/] ({why}) with {done} of {cfg.rl.steps} steps done; "
                              f"continue from the last checkpoint: dice-ray train --resume {run_dir}")
        raise
    except Exception as e:
        mark_stopped(run_dir, error_line(e), cfg.rl.steps)
        raise
    finally:
        trainer.shutdown()
        if previous is not None:
            import signal

            signal.signal(signal.SIGTERM, previous)


class Terminated(KeyboardInterrupt):
    """The run got SIGTERM (``ray job stop``, a batch scheduler's pre-emption, ``kill``): it stops as on Ctrl-C."""


def _stop_on_sigterm():
    """Make SIGTERM stop the run as Ctrl-C does (the steps done and the ``--resume`` command printed,
    ``stopped.json`` written, the actors shut down): it printed a Ray stack trace and exited 134 without either (a
    fresh user's trial). Returns the previous handler to restore, or None off the main thread (signals are set
    there only)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    def terminated(signum, frame):
        raise Terminated(f"signal {signum}")

    return signal.signal(signal.SIGTERM, terminated)


def _calm_further_interrupts(console: Console) -> None:
    """After the first Ctrl-C or SIGTERM, another one (while the actors and the local Ray cluster shut down) only
    says that the run is stopping: raised inside Ray's own shutdown, and again in its exit handler, it printed
    tracebacks (a fresh user's trial, stop 38).  Main thread only (signals are set there)."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        def calm(*_):
            console.print("stopping: the actors and Ray are shutting down (Ctrl-\\ kills at once)")

        for sig in (signal.SIGINT, signal.SIGTERM):  # a second SIGTERM while shutting down raised inside Ray's too
            signal.signal(sig, calm)

