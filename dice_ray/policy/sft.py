"""``dice-ray sft`` / ``jobs/sft.py`` (:func:`run_sft`): the warm start's training on a task spec's pairs as a command.

One process, world size 1, through a DeepSpeed engine (:class:`~dice_ray.policy.sft_run.SFTRun` with ``use_deepspeed``:
ZeRO stage ``sft.zero_stage``, bf16 when ``model.dtype`` is bfloat16; gloo on CPU, NCCL on GPU) -- or, with
``cluster.learner_ranks`` N > 1, N data-parallel DeepSpeed ranks (Ray actors, one GPU each where there are GPUs;
each rank a shard of every batch, gradients averaged: the steps 1 rank takes, within float rounding), with DeepSpeed
checkpoints, ``--resume`` and per-step metrics; its output folder is a saved policy (:meth:`DiffusionPolicy.save`) that
``dice-ray train model.path=OUT`` starts RL from. At ZeRO stage 0 in float32 its weights equal the warm
start's (:mod:`dice_ray.policy.sft_warm_start`) for the same pairs, config and seed, bit for bit (DeepSpeed's fp32
clipping and one-rank gradient all-reduce change no value; the tests check it).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager, redirect_stdout
from pathlib import Path

import torch
import yaml

from dice_ray.config import DiceConfig, load_config
from dice_ray.policy.policy import DiffusionPolicy
from dice_ray.policy.sft_run import STATE_FILE, SFTRun, torch_threads
from dice_ray.policy.sft_warm_start import sft_cache_key

SFT_CONFIG_FILE = "sft_config.yaml"
SFT_METRICS_FILE = "sft_metrics.jsonl"
SFT_SUMMARY_FILE = "sft_summary.json"


class SFTInputError(ValueError):
    """Unusable input to :func:`run_sft`; the message is one line naming the input and the rule."""


def sft_data_pairs(spec: str, cfg: DiceConfig, log: Callable[[str], None] = lambda s: None) -> list[tuple[str, ...]]:
    """The training pairs the trainer's warm start learns for task spec ``spec`` under ``cfg``.

    Same selection as :meth:`dice_ray.cluster.trainer.Trainer._warm_start`: the first ``tasks.max_tasks``
    accepted tasks, less the held-out split (``tasks.heldout_fraction``), those with a reference solution,
    each giving :func:`dice_ray.tasks.prompts.sft_pairs` in template ``tasks.prompt_template`` for the family
    ``model.family`` (LLaDA / Dream infill pairs are (before, middle, after) triples).

    Raises:
        SFTInputError: ``spec`` is unknown, names no readable file, or yields no pair.
    """
    from dice_ray.tasks.loaders import load_tasks, select_tasks, split_tasks
    from dice_ray.tasks.prompts import training_pairs

    try:
        report = load_tasks(spec, max_input_elements=cfg.tasks.max_input_elements)
    except (ValueError, FileNotFoundError) as e:
        raise SFTInputError(f"--data {spec}: {e}") from None
    log(f"tasks {report.summary()}")
    tasks = select_tasks(report.tasks, cfg.tasks.max_tasks, cfg.tasks.solution_variants)
    train, heldout = split_tasks(tasks, cfg.tasks.heldout_fraction)
    pairs, uncut = training_pairs(train, cfg.tasks.prompt_template, cfg.model.family, cfg.phase.scaffold_granularity)
    if not pairs:
        first = f"; first rejection: {report.rejected[0].source}: {report.rejected[0].reason}" if report.rejected else ""
        why = (f"{len(train)} training task(s), none with a reference solution to learn" if train
               else "no task accepted")
        raise SFTInputError(f"--data {spec}: {why} ({report.summary()}{first})".replace("\n", " "))
    skipped = (f"; {uncut} whose solution cannot be cut at phase.scaffold_granularity="
               f"{cfg.phase.scaffold_granularity} skipped" if uncut else "")
    log(f"pairs {len(pairs)} from {len(train)} training task(s); {len(heldout)} held out "
        f"(tasks.heldout_fraction={cfg.tasks.heldout_fraction}){skipped}")
    return pairs


def _checkpoints(out: Path) -> list[Path]:
    ckpt = out / "checkpoints"
    return sorted(ckpt.glob(f"step_*/{STATE_FILE}")) if ckpt.is_dir() else []


def _save_checkpoint(run: SFTRun, out: Path, key: str, keep: int) -> Path:
    """``out/checkpoints/step_NNNNNN/`` (:meth:`SFTRun.save`, written to a temporary folder and renamed);
    older ones beyond ``keep`` deleted. With several ranks every rank writes its part of the DeepSpeed
    checkpoint into one temporary folder (``.step_NNNNNN.ranks``; the ranks share ``out``'s file system) and
    rank 0 renames it."""
    ckpt = out / "checkpoints"
    final = ckpt / f"step_{run.step:06d}"
    if run.world_size == 1:
        ckpt.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=ckpt, prefix=f".{final.name}."))
        run.save(tmp, {"key": key})
    else:
        import torch.distributed as dist

        tmp = ckpt / f".{final.name}.ranks"
        if run.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        run.save(tmp, {"key": key})
        dist.barrier()
    if run.rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in [p.parent for p in _checkpoints(out)][:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    if run.world_size > 1:
        dist.barrier()
    return final


def _changed_settings(old: DiceConfig, new: DiceConfig) -> list[str]:
    """``KEY OLD -> NEW`` for the dotted config keys whose values differ between two
    :class:`~dice_ray.config.DiceConfig`, in key order."""
    def flat(tree: dict, prefix: str = "") -> dict[str, object]:
        out: dict[str, object] = {}
        for k, v in tree.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    a, b = flat(old.model_dump(mode="json")), flat(new.model_dump(mode="json"))
    return [f"{k} {a.get(k)} -> {b.get(k)}" for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]


def run_sft(
    data: str | None,
    out: str | Path,
    config_path: str | None = None,
    overrides: list[str] | None = None,
    resume: bool = False,
    log: Callable[[str], None] = lambda s: None,
) -> dict:
    """``dice-ray sft``: masked-diffusion SFT of the policy on a task set's solutions, written to ``out``.

    The same training as the trainer's warm start (:func:`~dice_ray.policy.sft_warm_start.warm_start` on the pairs of
    :func:`sft_data_pairs`, initial weights ``DiffusionPolicy.from_config(model)``, seed ``sft.seed`` or ``rl.seed``), as a
    command of its own, through a one-process DeepSpeed engine (:class:`SFTRun` with ``use_deepspeed``: ZeRO
    stage ``sft.zero_stage``, bf16 when ``model.dtype`` is bfloat16, on the GPU when there is one): no cache,
    a checkpoint (DeepSpeed's, plus the data order and RNG) every ``sft.checkpoint_every`` steps and at the
    end, and ``resume`` to continue from the last one. ``out`` receives the policy
    (``DiffusionPolicy.save``: start RL from it with ``dice-ray train model.path=OUT``), ``sft_config.yaml``
    (the resolved config), ``sft_metrics.jsonl`` (one record a step: step, loss, lr, tokens, seconds,
    tokens_per_s), ``sft_summary.json``, ``sft_run.json`` (the data spec and the content hash a resume must
    match) and ``checkpoints/step_NNNNNN/`` (the last ``keep_checkpoints``).

    Args:
        data: task spec of :func:`dice_ray.tasks.loaders.load_tasks` (``builtin``, ``alpaca:PATH``,
            ``dice:PATH``, ...); None means the config's ``tasks.spec`` (``builtin`` by default), or with
            ``resume`` the spec the run was started with.
        out: the run folder.
        config_path, overrides: YAML config and ``key=value`` overrides (:func:`dice_ray.config.load_config`);
            with ``resume`` the run's ``sft_config.yaml`` replaces ``config_path``.
        resume: continue the run in ``out`` from its last checkpoint.
        log: receives one progress line at a time.

    Returns:
        the summary (also in ``sft_summary.json``): out, data, pairs, steps, final_loss, stopped_early,
        seconds, resumed_from, train_command.

    Raises:
        SFTInputError: bad spec, no pair, ``out`` already holds a run (without ``resume``) or none (with it),
            a run started on other pairs / model / SFT config (``sft.zero_stage`` included) / seed (with
            ``resume``), ``sft.steps`` 0, a pair longer than ``model.max_position_embeddings``, ``out``
            cannot be created, a damaged ``sft_run.json`` (with ``resume``).
        FileNotFoundError: ``config_path`` does not exist.
        pydantic.ValidationError: a bad config key or value.
    """
    with _stdout_to_stderr():
        ranks = _ranks(out, config_path, overrides, resume)
        if ranks > 1:
            return _run_sft_ranks(ranks, data, out, config_path, overrides, resume, log)
        return _run_sft(data, out, config_path, overrides, resume, log)


def _ranks(out, config_path, overrides, resume) -> int:
    """``cluster.learner_ranks`` of the config the run will load (1 where it cannot be read: :func:`_run_sft`
    then says why)."""
    try:
        path = Path(out).expanduser() / SFT_CONFIG_FILE if resume else config_path
        return load_config(path, list(overrides or [])).cluster.learner_ranks
    except Exception:
        return 1


class _SFTRank:
    """One rank of a ``dice-ray sft`` run on several ranks (a Ray actor: :func:`_run_sft_ranks`)."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    def rendezvous(self) -> tuple[str, int]:
        """This node's IP and a free port on it (the rendezvous rank 0 serves)."""
        import socket

        import ray

        with socket.socket() as sock:
            sock.bind(("", 0))
            return ray.util.get_node_ip_address(), sock.getsockname()[1]

    def run(self, addr: str, port: int, *args) -> dict:
        from dice_ray.policy.deepspeed_setup import init_rank_group

        init_rank_group(self.rank, self.world_size, addr, port)
        log = (lambda line: print(line, file=sys.stderr, flush=True)) if self.rank == 0 else (lambda line: None)
        with _stdout_to_stderr():
            return _run_sft(*args, log, rank=self.rank, world_size=self.world_size)


def _run_sft_ranks(n: int, data, out, config_path, overrides, resume, log) -> dict:
    """:func:`_run_sft` on ``n`` data-parallel DeepSpeed ranks, Ray actors (the Ray cluster of ``RAY_ADDRESS``, else
    a local one started here): one GPU a rank in a packed placement group where this machine has a GPU (gloo on
    CPU otherwise). Rank 0 writes the run folder; returns its summary.

    Raises:
        PlacementTimeout: the ranks' GPUs were not placed within
            :data:`~dice_ray.cluster.placement.PLACEMENT_TIMEOUT_S`.
    """
    import os

    import ray

    from dice_ray.config import DEEPSPEED_OPS_DIR

    started = not ray.is_initialized()
    if started:
        ray.init(include_dashboard=False, log_to_driver=True)
    use_gpu = torch.cuda.is_available()
    env = {"TORCH_EXTENSIONS_DIR": os.path.expanduser(DEEPSPEED_OPS_DIR)} | ({} if use_gpu else {"DS_ACCELERATOR": "cpu"})
    placement = None
    try:
        opts: list[dict] = [{"num_gpus": 0}] * n
        if use_gpu:
            from dice_ray.cluster.placement import PLACEMENT_TIMEOUT_S, RolePlacement, reserve

            bundles = [{"GPU": 1} for _ in range(n)]
            group = reserve("sft ranks", bundles, "PACK", PLACEMENT_TIMEOUT_S)
            placement = RolePlacement("sft ranks", [1.0] * n, [0.0] * n, group, list(range(n)), bundles, "PACK")
            opts = [placement.options(i) for i in range(n)]
        actor = ray.remote(num_cpus=0)(_SFTRank)
        ranks = [actor.options(runtime_env={"env_vars": env}, **o).remote(i, n) for i, o in enumerate(opts)]
        log(f"{n} ranks (cluster.learner_ranks={n}), {'NCCL' if use_gpu else 'gloo'}")
        addr, port = ray.get(ranks[0].rendezvous.remote())
        args = (data, str(Path(out).expanduser().resolve()), config_path, list(overrides or []), resume)
        outs = ray.get([r.run.remote(addr, port, *args) for r in ranks])
        for r in ranks:
            ray.kill(r)
        return outs[0]
    finally:
        if placement is not None:
            placement.remove()
        if started:
            ray.shutdown()


def _run_sft(data, out, config_path, overrides, resume, log, rank: int = 0, world_size: int = 1) -> dict:
    """:func:`run_sft`'s body (its stdout sent to stderr); ``rank`` of ``world_size`` data-parallel ranks (their
    ``torch.distributed`` group joined already; rank 0 writes the run folder)."""
    t0 = time.perf_counter()
    out = Path(out).expanduser().resolve()
    overrides = list(overrides or [])
    if out.exists() and not out.is_dir():
        raise SFTInputError(f"--out {out}: exists and is not a folder")
    run_file = out / "sft_run.json"
    if resume:
        if config_path is not None:
            raise SFTInputError(f"--resume reads {out / SFT_CONFIG_FILE}; pass overrides, not --config")
        if not (out / SFT_CONFIG_FILE).is_file() or not run_file.is_file():
            raise SFTInputError(f"--resume {out}: no {SFT_CONFIG_FILE} (not a dice-ray sft run folder)")
        try:
            saved = json.loads(run_file.read_text(encoding="utf-8"))
            if not isinstance(saved, dict) or not isinstance(saved.get("data"), str):
                raise ValueError("not an object with a str 'data'")
        except (OSError, ValueError) as e:  # JSONDecodeError, UnicodeDecodeError are ValueErrors
            raise SFTInputError(f"--resume {out}: {run_file.name} is damaged ({e}); start a new --out") from None
        data = data or saved["data"]
        cfg = load_config(out / SFT_CONFIG_FILE, overrides)
    else:
        if (out / SFT_CONFIG_FILE).exists() or _checkpoints(out):
            raise SFTInputError(f"--out {out}: holds a dice-ray sft run already; pass --resume to continue it "
                                "or choose another folder")
        cfg = load_config(config_path, overrides)
        data = data or cfg.tasks.spec  # the train job's tasks (the built-in suite by default)
    if cfg.sft.steps < 1:
        raise SFTInputError(f"sft.steps={cfg.sft.steps}: nothing to train (need >= 1)")
    try:  # before any work: a run must not fail after loading its data for want of a folder
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SFTInputError(f"--out {out}: cannot create the folder ({e.strerror or e})") from None

    pairs = sft_data_pairs(data, cfg, log)
    policy = DiffusionPolicy.from_config(cfg.model)
    # the warm start's key, and the ZeRO stage: a resume must find the checkpoint layout it wrote
    key = f"{sft_cache_key(policy, pairs, cfg.sft, cfg.sft_seed)}-zero{cfg.sft.zero_stage}"
    if world_size > 1:  # ZeRO's checkpoint is partitioned by rank: a resume keeps the rank count
        key += f"-ranks{world_size}"
    if torch.cuda.is_available():
        policy.to("cuda")
    try:
        run = SFTRun(policy, pairs, cfg.sft, cfg.sft_seed, use_deepspeed=True, data_parallel=world_size > 1)
    except ValueError as e:  # a pair too long for the model
        raise SFTInputError(f"--data {data}: {e} (raise model.max_position_embeddings or cap tasks.max_tasks)") from None
    if world_size > 1:  # every rank past the checks above before rank 0 writes the folder
        torch.distributed.barrier()
    lead = rank == 0
    metrics = out / SFT_METRICS_FILE
    resumed_from = None
    if resume:
        if saved.get("key") != key:
            changed = _changed_settings(load_config(out / SFT_CONFIG_FILE), cfg)
            what = (f"settings differ from the run's: {', '.join(changed)}" if changed
                    else f"the pairs --data {data} gives differ from the run's")
            raise SFTInputError(f"--resume {out}: {what}; a run continues with the data and settings it started "
                                "with (train longer or differently in a new --out)")
        ckpts = _checkpoints(out)
        if ckpts:
            run.load(ckpts[-1].parent)
            log(f"resumed from {ckpts[-1].parent} at step {run.step}")
        else:
            log("no checkpoint yet: starting again from step 0")
        resumed_from = run.step
        if lead:
            kept = [ln for ln in (metrics.read_text().splitlines() if metrics.exists() else [])
                    if ln.strip() and json.loads(ln)["step"] <= run.step]
            metrics.write_text("".join(ln + "\n" for ln in kept))
    elif lead:
        out.mkdir(parents=True, exist_ok=True)
        (out / SFT_CONFIG_FILE).write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        run_file.write_text(json.dumps({"data": data, "key": key, "pairs": len(pairs)}, indent=1))
        metrics.write_text("")

    log(f"training {policy.num_parameters()} parameters, {cfg.sft.steps} steps at most, batch {cfg.sft.batch_size}")
    with torch_threads(cfg.sft.num_threads), (metrics.open("a") if lead else open(os.devnull, "w")) as f:
        while not run.finished:
            rec = run.train_step()
            f.write(json.dumps(rec) + "\n")
            f.flush()
            if run.losses and run.losses[-1][0] == run.step:  # a logged window ends here (what final_loss reports)
                log(f"step {run.step}/{cfg.sft.steps} loss {run.losses[-1][1]:.4f} (mean since the last line) "
                    f"lr {rec['lr']:.2e} tokens/s {rec['tokens_per_s']:.0f}")
            if run.step % cfg.sft.checkpoint_every == 0 and not run.finished:
                log(f"checkpoint {_save_checkpoint(run, out, key, cfg.keep_checkpoints)}")
    policy.model.eval()
    _save_checkpoint(run, out, key, cfg.keep_checkpoints)
    if lead:
        policy.save(out)
    summary = {
        "out": str(out), "data": data, "pairs": len(pairs), "steps": run.step,
        "final_loss": run.losses[-1][1] if run.losses else None, "stopped_early": run.stopped,
        "seconds": time.perf_counter() - t0, "resumed_from": resumed_from,
        "train_command": f"dice-ray train model.path={out}",
    }
    if world_size > 1:
        summary["ranks"] = world_size
    if lead:
        (out / SFT_SUMMARY_FILE).write_text(json.dumps(summary, indent=1))
    return summary


@contextmanager
def _stdout_to_stderr():
    """Python prints and DeepSpeed's log lines (its logger writes to stdout) go to stderr in the block:
    ``dice-ray sft`` prints only its JSON summary on stdout."""
    import logging

    moved = [h for h in logging.getLogger("DeepSpeed").handlers
             if isinstance(h, logging.StreamHandler) and h.stream is sys.stdout]
    for h in moved:
        h.setStream(sys.stderr)
    try:
        with redirect_stdout(sys.stderr):
            yield
    finally:
        for h in moved:
            h.setStream(sys.stdout)
