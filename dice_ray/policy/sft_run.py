"""One masked-diffusion SFT run (any family) as a resumable state, :class:`SFTRun`: weights, AdamW moments, lr
schedule, data order, mask RNG; stepped by plain torch or through a DeepSpeed engine, on one rank or data-parallel on
several.

Optimiser: AdamW (betas 0.9, 0.98), gradient-norm clipping, linear warm-up
and cosine decay to ``min_lr_ratio`` (a ``LambdaLR``; :mod:`dice_ray.policy.sft_optim`), ``gradient_accumulation_steps``
batches a step. Losses: :mod:`dice_ray.policy.sft_loss`; batches: :mod:`dice_ray.policy.sft_batches`; the engine:
:func:`dice_ray.policy.deepspeed_setup.deepspeed_engine`. Two callers:

* :func:`dice_ray.policy.sft_warm_start.warm_start`, the trainer's warm start (plain torch, cached by content hash);
* :func:`dice_ray.policy.sft.run_sft`, ``dice-ray sft`` (through a DeepSpeed engine, resumable).
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from dice_ray.config import SFTConfig
from dice_ray.policy.deepspeed_setup import deepspeed_engine
from dice_ray.policy.policy import DiffusionPolicy
from dice_ray.policy.sft_batches import length_batches, tokenize_pairs
from dice_ray.policy.sft_loss import diffusion_loss
from dice_ray.policy.sft_optim import clip_grad_norm, lr_at

STATE_FILE = "sft_state.pt"
"""A checkpoint's run state (:meth:`SFTRun.save`), written last: a folder without it is an unfinished checkpoint."""
DS_TAG = "ds"  # the DeepSpeed checkpoint's folder inside a checkpoint


class SFTRun:
    """One masked-diffusion SFT run (any family) as a resumable state: weights, AdamW moments, lr schedule, data
    order, mask RNG.

    :func:`~dice_ray.policy.sft_warm_start.warm_start` (the trainer's warm start, plain torch) and ``dice-ray sft``
    (:func:`~dice_ray.policy.sft.run_sft`, through a DeepSpeed engine) both step it. One generator, seeded with
    ``seed``, draws the epochs' batch orders (:func:`length_batches`) and the masks (:func:`diffusion_loss`); a run
    restored from :meth:`save` (or, plain torch only, :meth:`state_dict`) takes the same steps (bit for bit on the
    same machine and thread count) as one that never stopped.

    Args:
        policy: trained in place (its model is put in train mode by :meth:`train_step`).
        pairs: (prompt, target) texts, or (LLaDA / Dream) (before, middle, after) infill triples.
        cfg: steps, batch size, accumulation, AdamW and schedule (see :class:`~dice_ray.config.SFTConfig`).
        seed: seed of the data order and the masks.
        use_deepspeed: step through :func:`deepspeed_engine` (ZeRO stage ``cfg.zero_stage``, bf16 when the
            policy's ``model_cfg.dtype`` is bfloat16; makes this process a one-rank ``torch.distributed``
            group). False: plain ``torch.optim.AdamW`` with ``torch.nn.utils.clip_grad_norm_``.
        data_parallel: this process is one rank of the ``torch.distributed`` group it already belongs to
            (:func:`~dice_ray.policy.deepspeed_setup.init_rank_group`): every rank draws the same data order and
            masks, runs its shard of each batch (``diffusion_loss(shard=...)``) and the gradients are averaged
            (by the DeepSpeed engine, or on the plain path an all-reduce before clipping), so N ranks take the
            steps one rank takes on the same batches (within float rounding). Every rank must start from the same
            weights. A group of one rank runs the one-rank path.

    Attributes:
        step: optimizer steps taken.
        stopped: ``cfg.target_loss`` was reached (the run ends before ``cfg.steps``).
        losses: ``(step, mean loss of the window ending there)`` every ``cfg.log_every`` steps.
        engine: the DeepSpeed engine, or None on the plain path.

    Raises:
        ValueError: ``pairs`` is empty or a pair is too long (see :func:`~dice_ray.policy.sft_batches.tokenize_pairs`).
        RuntimeError: ``use_deepspeed`` without ``data_parallel`` in a process that belongs to a group of more than
            one rank, or ``data_parallel`` in a process in no group.
    """

    def __init__(self, policy: DiffusionPolicy, pairs: list[tuple[str, ...]], cfg: SFTConfig, seed: int,
                 use_deepspeed: bool = False, data_parallel: bool = False):
        import torch.distributed as dist

        if not pairs:
            raise ValueError("pairs: need at least one (prompt, target) pair")
        self.policy, self.cfg = policy, cfg
        self.items = tokenize_pairs(policy, pairs)
        self._costs = [len(p) + 3 * len(t) + sum(map(len, after)) for p, t, *after in self.items]
        self.gen = torch.Generator().manual_seed(seed)
        self.opt = torch.optim.AdamW(policy.model.parameters(), lr=cfg.learning_rate, betas=(0.9, 0.98),
                                     weight_decay=cfg.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_at(s, cfg) / cfg.learning_rate)
        self.engine = None
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if data_parallel else (0, 1)
        self._shard = (self.rank, self.world_size) if self.world_size > 1 else None
        if use_deepspeed:
            bf16 = policy.model_cfg.dtype == "bfloat16"
            self.engine = deepspeed_engine(policy.model, self.opt, self.sched, cfg, bf16, data_parallel)
        self.step = 0
        self.stopped = False
        self.losses: list[tuple[int, float]] = []
        self._window: list[float] = []
        self._batches: list[list[int]] = []
        self._ema: float | None = None

    @property
    def finished(self) -> bool:
        """True once ``cfg.steps`` steps are taken or ``cfg.target_loss`` stopped the run."""
        return self.stopped or self.step >= self.cfg.steps

    def _next_batch(self) -> list[tuple[list[int], ...]]:
        if not self._batches:
            self._batches = length_batches(self._costs, self.cfg.batch_size, self.gen)
        return [self.items[i] for i in self._batches.pop()]

    def train_step(self) -> dict:
        """One optimizer step on the next ``cfg.gradient_accumulation_steps`` batches.

        Returns:
            ``{"step", "loss", "lr", "tokens", "seconds", "tokens_per_s"}``: the step number (1-based), the mean
            :func:`diffusion_loss` (nats) of its batches, the lr it used, their prompt + target tokens,
            its wall time (s) and tokens / s.

        Raises:
            RuntimeError: the run is already :attr:`finished`.
        """
        if self.finished:
            raise RuntimeError(f"SFT run finished at step {self.step}: no step left")
        t0 = time.perf_counter()
        cfg, model, engine = self.cfg, self.policy.model, self.engine
        accum = cfg.gradient_accumulation_steps
        lr = self.opt.param_groups[0]["lr"]
        model.train()
        if engine is None:
            self.opt.zero_grad(set_to_none=True)
        total, tokens = 0.0, 0
        for _ in range(accum):
            batch = self._next_batch()
            loss, _ = diffusion_loss(self.policy, batch, self.gen, cfg.complementary_mask, shard=self._shard)
            if engine is not None:
                engine.backward(loss)  # divides by gradient_accumulation_steps
                engine.step()  # clip, AdamW and schedule at the accumulation boundary only
            else:
                (loss / accum).backward()
            total += loss.item()
            tokens += sum(sum(map(len, item)) for item in batch)
        if self._shard is not None:  # the batches' loss: the mean of the ranks' weighted shares
            import torch.distributed as dist

            if engine is None:  # the ranks' mean gradient (DeepSpeed's engine averages its own)
                for p in model.parameters():
                    if p.grad is not None:
                        dist.all_reduce(p.grad)
                        p.grad.div_(self.world_size)
            summed = torch.tensor([total], dtype=torch.float64)
            dist.all_reduce(summed)
            total = float(summed) / self.world_size
        if engine is None:
            clip_grad_norm(model.parameters(), cfg.max_grad_norm)
            self.opt.step()
            self.sched.step()
        value = total / accum
        self._window.append(value)
        self._ema = value if self._ema is None else 0.9 * self._ema + 0.1 * value
        self.stopped = cfg.target_loss is not None and self.step >= 20 and self._ema < cfg.target_loss
        self.step += 1
        if self.step % cfg.log_every == 0 or self.step == cfg.steps or self.stopped:
            self.losses.append((self.step, sum(self._window) / len(self._window)))
            self._window = []
        seconds = time.perf_counter() - t0
        return {"step": self.step, "loss": value, "lr": lr, "tokens": tokens, "seconds": seconds,
                "tokens_per_s": tokens / max(seconds, 1e-9)}

    def state_dict(self) -> dict:
        """Everything that decides the next steps: step, loss window, pending batches, generator, and (plain
        torch only; a DeepSpeed run keeps them in its engine checkpoint, :meth:`save`) model, optimizer and
        lr schedule."""
        state = {
            "step": self.step, "stopped": self.stopped, "losses": [list(x) for x in self.losses],
            "window": list(self._window), "batches": [list(b) for b in self._batches], "ema": self._ema,
            "generator": self.gen.get_state(),
        }
        if self.engine is None:
            state.update(model=self.policy.model.state_dict(), optimizer=self.opt.state_dict(),
                         scheduler=self.sched.state_dict())
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict` (of a run on the same pairs, config and seed, on the same path)."""
        if self.engine is None:
            self.policy.model.load_state_dict(state["model"])
            self.opt.load_state_dict(state["optimizer"])
            self.sched.load_state_dict(state["scheduler"])
        self.gen.set_state(state["generator"])
        self.step, self.stopped, self._ema = int(state["step"]), bool(state["stopped"]), state["ema"]
        self.losses = [(int(s), float(v)) for s, v in state["losses"]]
        self._window = [float(v) for v in state["window"]]
        self._batches = [[int(i) for i in b] for b in state["batches"]]

    def save(self, folder: Path, extra: dict | None = None) -> None:
        """Write the run to the new folder ``folder``: ``sft_state.pt`` (:meth:`state_dict` + ``extra``), and
        with DeepSpeed the engine checkpoint (``engine.save_checkpoint``, tag ``ds``: weights, optimizer --
        ZeRO's partitions and fp32 master weights included -- and lr schedule). ``sft_state.pt`` is written
        last: a folder without it is an unfinished checkpoint."""
        folder.mkdir(parents=True, exist_ok=True)
        if self.engine is not None:
            self.engine.save_checkpoint(str(folder), tag=DS_TAG, save_latest=False)
        if self.rank == 0:  # every rank holds the same state (data order, masks, losses)
            torch.save({**(extra or {}), **self.state_dict()}, folder / STATE_FILE)

    def load(self, folder: Path) -> dict:
        """Restore a run written by :meth:`save` on the same path (plain / DeepSpeed, same ZeRO stage).

        Returns:
            the ``extra`` entries :meth:`save` was given.

        Raises:
            FileNotFoundError: the folder lacks ``sft_state.pt`` or (with DeepSpeed) the engine checkpoint.
        """
        state = torch.load(folder / STATE_FILE, map_location="cpu", weights_only=True)
        if self.engine is not None:
            if not (folder / DS_TAG).is_dir():
                raise FileNotFoundError(f"{folder}: no DeepSpeed checkpoint {DS_TAG}/ (a run of another engine)")
            path, _ = self.engine.load_checkpoint(str(folder), tag=DS_TAG, load_optimizer_states=True,
                                                  load_lr_scheduler_states=True)
            if path is None:
                raise FileNotFoundError(f"{folder / DS_TAG}: DeepSpeed could not load this checkpoint")
        self.load_state_dict(state)
        known = {"step", "stopped", "losses", "window", "batches", "ema", "generator", "model", "optimizer",
                 "scheduler"}
        return {k: v for k, v in state.items() if k not in known}


@contextmanager
def torch_threads(n: int | None):
    """torch CPU threads set to ``n`` (None: every core this process may use) for the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(n or len(os.sched_getaffinity(0)))
    try:
        yield
    finally:
        torch.set_num_threads(before)
