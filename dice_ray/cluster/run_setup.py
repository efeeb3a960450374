"""The set-up of a run before its first step (:class:`RunSetup`, the :class:`~dice_ray.cluster.trainer.Trainer`'s):
the tasks, then Ray, the run folder, the actors (verifier pool, rollout workers, phase scheduler, learner, weight
sync), the warm start or the restore of a checkpoint, and the step pipeline."""

from __future__ import annotations

import json
import os
from collections import Counter

import ray
import yaml
from rich.markup import escape

from dice_ray.cluster.checkpoint import resume_point
from dice_ray.cluster.console import describe_learner, describe_warm_start, waiting
from dice_ray.cluster.evaluation import Evaluations
from dice_ray.cluster.learner import LearnerGroup, learner_env
from dice_ray.cluster.metrics import GpuBusySampler, RunMetrics, StageTimeline
from dice_ray.cluster.pipeline import StepPipeline
from dice_ray.cluster.placement import describe, learner_placement, rollout_placement
from dice_ray.cluster.ray_start import start_ray
from dice_ray.cluster.rollout import ROLLOUT_MAX_RESTARTS, RolloutWorker
from dice_ray.cluster.scheduler import NAMESPACE, SCHEDULER_NAME, PhaseSchedulerActor
from dice_ray.cluster.verifier_pool import POOL_NAME, VerifierPool
from dice_ray.cluster.weight_sync import WeightSync, resolve_mode
from dice_ray.report import STOPPED_FILE, read_metrics
from dice_ray.tasks.loaders import load_tasks, phase_pool, select_tasks, split_tasks
from dice_ray.tasks.prompts import infill_blocker
from dice_ray.verify.verifier import AUTO_GPU_WORKERS


class RunSetup:
    """The :class:`~dice_ray.cluster.trainer.Trainer`'s set-up (a base class of it). It reads what the trainer's
    constructor sets (``cfg``, ``console``, ``run_dir``, ``resume``, ``ckpt_dir``, ``store``) and sets what the loop
    uses: ``ray_info``, ``tasks`` (by id), ``train_tasks``, ``heldout``, ``pools`` (each phase's training tasks),
    ``unfit``, ``metrics``, the placements ``learner_placement`` and ``rollout_placement``
    (:mod:`~dice_ray.cluster.placement`), the actors ``pool``, ``rollout_workers``, ``scheduler``, ``learner``, ``weight_sync``,
    ``evals``, and (resuming) ``start_step`` / ``weights_version``; :meth:`_start_pipeline` then ``timeline``,
    ``pipeline`` and ``gpu_sampler``.
    """

    def setup(self) -> None:
        """The tasks, Ray, the run folder and the actors; then the warm start (a new run) or the restore of the newest
        checkpoint (a resumed one), and the first weight push to the rollout workers."""
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
        # the learner's whole GPUs first, then the rollout workers' (in the learner's bundles when colocated); the
        # verifiers' slots are placed by the pool (dice_ray.cluster.placement)
        use_gpu = bool(gpus and cfg.cluster.learner_gpus)
        self.learner_placement = learner_placement(cfg, use_gpu)
        self.rollout_placement = rollout_placement(cfg, bool(gpus), self.learner_placement)
        where = describe(self.learner_placement, self.rollout_placement, gpus_per_verifier, cfg.cluster.placement)
        con.print(f"[bold]placement[/] {where}", highlight=False)
        self.rollout_workers = [
            # restartable, no task retries: a restarted worker must be re-synced before it samples (pipeline.py);
            # its bundle is in its options, so a restart keeps it
            RolloutWorker.options(
                **self.rollout_placement.options(i), max_restarts=ROLLOUT_MAX_RESTARTS, max_task_retries=0
            ).remote(
                cfg.model, cfg.sampling, cfg.tasks.prompt_template, threads, cfg.phase.scaffold_granularity,
                self.rollout_placement.colocated,
            )
            for i in range(cfg.cluster.num_rollout_workers)
        ]
        self.pools = self._phase_pools()
        self.evals = Evaluations(cfg, con, self.rollout_workers, self.pool, self.tasks, self.pools, self.heldout, self.unfit)
        self.scheduler = PhaseSchedulerActor.options(name=SCHEDULER_NAME, namespace=NAMESPACE).remote(
            [(t.task_id, t.level) for t in self.pools["infill"]], [(t.task_id, t.level) for t in self.pools["e2e"]],
            cfg.phase, cfg.rl.prompts_per_step, cfg.rl.seed, cfg.rl.max_staleness, bool(self.resume)
        )
        ranks = cfg.cluster.learner_ranks
        self.learner = LearnerGroup(cfg, use_gpu, max(1, threads // ranks) if threads else 0, learner_env(use_gpu),
                                    self.learner_placement)
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
        with waiting(con, f"warm start: the learner starts, then masked-diffusion SFT on {len(pairs)} pairs (or loads "
                          f"the result cached by an earlier run)"):
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

    @property
    def queued_sync(self) -> bool:
        """Whether the step's weight push is queued behind the rollouts launched ahead instead of waiting
        for them: an asynchronous run (``rl.max_staleness > 0``) syncing through the object store. A
        broadcast is a collective every worker joins at once, so it waits for the rollouts ahead first."""
        return self.cfg.rl.max_staleness > 0 and self.weight_sync.mode == "object_store"
