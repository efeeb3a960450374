"""The learner: DeepSpeed ranks as Ray actors taking GRPO-family steps on diffusion-policy log-probs.

Each rank builds the policy, warm-starts it (masked-diffusion SFT, cached), wraps it in a DeepSpeed
engine (ZeRO stage from config; gloo on CPU with ``DS_ACCELERATOR=cpu``, NCCL on GPU; client
``torch.optim.AdamW``) and, each RL step, computes per-token log-probs of every rollout with
``rl.logprob_estimator`` (:mod:`dice_ray.policy.logprobs`; default TraceRL's per-denoising-step
log-probs, Wang et al. 2025, DICE's estimator) and the clipped policy loss of
:func:`dice_ray.rl.loss.clipped_policy_loss`. Groups are micro-batches; one optimizer step a call.
TraceRL's ratio uses the behaviour log-probs the sampler recorded; the ``coupled`` and ``diffu_grpo``
estimators score a state the sampler never saw, so their old log-probs are recomputed at the start of
the step under the pre-update weights, with the same masks (:func:`estimator_seed`).
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass

import numpy as np
import ray
import torch

from dice_ray.config import DiceConfig


@dataclass
class TrainGroup:
    """One group as the learner consumes it (padded to the group's longest response).

    Attributes:
        prompt_ids: int64 [P].
        response_ids: int64 [G, R].
        unmask_step: int64 [G, R], the denoising step within its block at which a token was unmasked.
        mask: bool [G, R], True on real response tokens.
        behaviour_logprobs: float32 [G, R], log-probs recorded when the rollout was sampled.
        advantages: float32 [G].
    """

    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    unmask_step: torch.Tensor
    mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor


def make_train_group(prompt_ids: list[int], rollouts: list, advantages: torch.Tensor) -> TrainGroup:
    """Pad a group's rollouts into a :class:`TrainGroup` (pad id 0, masked out)."""
    g = len(rollouts)
    r = max(len(x.response_ids) for x in rollouts)
    ids = torch.zeros(g, r, dtype=torch.long)
    steps = torch.zeros(g, r, dtype=torch.long)
    mask = torch.zeros(g, r, dtype=torch.bool)
    blp = torch.zeros(g, r, dtype=torch.float32)
    for i, x in enumerate(rollouts):
        n = len(x.response_ids)
        ids[i, :n] = torch.tensor(x.response_ids)
        steps[i, :n] = torch.tensor(x.unmask_step)
        mask[i, :n] = True
        blp[i, :n] = torch.tensor(x.behaviour_logprobs)
    return TrainGroup(torch.tensor(prompt_ids, dtype=torch.long), ids, steps, mask, blp, advantages.float())


def estimator_seed(base: int, step: int, group: int) -> int:
    """Seed of a group's log-prob estimator masks (``coupled``) at one learner step: fixed per run seed,
    step and group, so the old-policy and new-policy log-probs of the step use the same masks."""
    return (base * 1_000_003 + step) * 65_537 + group


def learner_env(use_gpu: bool) -> dict:
    """Environment for a learner rank: DeepSpeed's CPU accelerator without GPUs, and a persistent
    ``TORCH_EXTENSIONS_DIR`` so DeepSpeed's JIT ops (shm comm: ~30 s) build once per machine."""
    env = {"TORCH_EXTENSIONS_DIR": os.path.expanduser("~/.cache/dice-ray/torch_extensions")}
    if not use_gpu:
        env["DS_ACCELERATOR"] = "cpu"
    return env


@ray.remote(num_cpus=0)
class Learner:
    """One DeepSpeed rank.

    Args:
        cfg: the run's config.
        rank, world_size: this rank in the learner group.
        master_addr, master_port: the rendezvous of ``torch.distributed``.
        num_threads: torch CPU threads (0: torch's default).
    """

    def __init__(self, cfg: DiceConfig, rank: int, world_size: int, master_addr: str, master_port: int, num_threads: int = 0):
        from dice_ray.policy.policy import DiffusionPolicy

        if num_threads:
            torch.set_num_threads(num_threads)
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.use_gpu = torch.cuda.is_available() and bool(ray.get_gpu_ids())
        self.device = torch.device("cuda", 0) if self.use_gpu else torch.device("cpu")
        os.environ.update(
            MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
            WORLD_SIZE=str(world_size), LOCAL_RANK="0",
        )
        self.policy = DiffusionPolicy.from_config(cfg.model)
        self.policy.model.to(self.device)
        self.engine = None
        self.ref_model = None
        self.step_count = 0

    def warm_start(self, pairs: list[tuple[str, str]]) -> dict:
        """Masked-diffusion SFT warm start (cached by content hash); before :meth:`init_engine`."""
        from dataclasses import asdict

        from dice_ray.policy.sft import warm_start

        report = warm_start(self.policy, pairs, self.cfg.sft, seed=self.cfg.rl.seed)
        return asdict(report)

    def init_engine(self) -> dict:
        """Wrap the policy in a DeepSpeed engine; returns what was set up."""
        import deepspeed

        t0 = time.perf_counter()
        backend = "nccl" if self.use_gpu else "gloo"
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group(backend, rank=self.rank, world_size=self.world_size)
        model = self.policy.model.to(self.device)
        # the SFT warm start leaves its last step's gradients on the parameters (a cache hit or a resume
        # does not), and DeepSpeed's first backward would add the RL gradient to them: start from none
        model.zero_grad(set_to_none=True)
        if self.cfg.rl.beta > 0:
            import copy

            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=self.cfg.rl.learning_rate, weight_decay=0.0)
        ds_config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": self.cfg.rl.max_grad_norm,
            "zero_optimization": {"stage": self.cfg.cluster.zero_stage},
            "bf16": {"enabled": self.cfg.model.dtype == "bfloat16"},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        return {"backend": backend, "zero_stage": self.cfg.cluster.zero_stage, "seconds": time.perf_counter() - t0,
                "device": str(self.device), "params": sum(p.numel() for p in model.parameters())}

    def train_step(self, groups: list[TrainGroup]) -> dict:
        """One optimizer step over ``groups`` (each a micro-batch), ``ppo_epochs`` passes.

        Returns:
            loss, clip fraction, KL, ratio mean, tokens, seconds, tokens/s.
        """
        from dice_ray.policy.logprobs import response_logprobs
        from dice_ray.rl.loss import clipped_policy_loss

        t0 = time.perf_counter()
        rl = self.cfg.rl
        block, mask_id = self.policy.block_size, self.policy.mask_id
        sums = {"loss": 0.0, "clip_fraction": 0.0, "kl": 0.0, "ratio_mean": 0.0}
        n_micro = 0
        tokens = 0
        self.engine.train()
        dev, est = self.device, rl.logprob_estimator
        seeds = [estimator_seed(rl.seed, self.step_count, i) for i in range(len(groups))]

        def logprobs_of(model, g: TrainGroup, seed: int) -> torch.Tensor:
            return response_logprobs(est, model, g.prompt_ids.to(dev), g.response_ids.to(dev), g.unmask_step.to(dev),
                                     g.mask.to(dev), block, mask_id, seed=seed)

        old = [g.behaviour_logprobs.to(dev) for g in groups]
        if est != "tracerl":  # the ratio's old log-probs: same estimator and masks, pre-update weights
            with torch.no_grad():
                old = [logprobs_of(self.engine.module, g, s) for g, s in zip(groups, seeds)]
        for _ in range(rl.ppo_epochs):
            for i, g in enumerate(groups):
                self.engine.set_gradient_accumulation_boundary(i == len(groups) - 1)
                logprobs = logprobs_of(self.engine.module, g, seeds[i])
                ref = None
                if self.ref_model is not None:
                    with torch.no_grad():
                        ref = logprobs_of(self.ref_model, g, seeds[i])
                loss, stats = clipped_policy_loss(
                    logprobs, old[i], g.advantages.to(dev), g.mask.to(dev),
                    epsilon=rl.epsilon, beta=rl.beta, ref_logprobs=ref,
                )
                self.engine.backward(loss / len(groups), scale_wrt_gas=False)
                for k in sums:
                    sums[k] += getattr(stats, k)
                n_micro += 1
                tokens += int(g.mask.sum())
            grad_norm = self._grad_norm()
            self.engine.step()
        if grad_norm is None:  # ZeRO >= 1: DeepSpeed's optimizer computed it in the step
            norm = self.engine.get_global_grad_norm()
            grad_norm = None if norm is None else float(norm)
        self.step_count += 1
        seconds = time.perf_counter() - t0
        out = {k: v / max(n_micro, 1) for k, v in sums.items()}
        out.update(tokens=tokens, grad_norm=grad_norm, seconds=seconds, tokens_per_s=tokens / max(seconds, 1e-9),
                   step=self.step_count)
        return out

    def _grad_norm(self) -> float | None:
        """L2 norm of the accumulated gradients before clipping (last PPO epoch); None under ZeRO >= 1,
        where the gradients are partitioned and DeepSpeed's optimizer reports its own norm in the step."""
        if self.cfg.cluster.zero_stage:
            return None
        grads = [p.grad.detach().float().norm() for p in self.engine.module.parameters() if p.grad is not None]
        return float(torch.stack(grads).norm()) if grads else None

    def get_weights(self) -> dict:
        """The policy's weights as CPU tensors (the object-store weight sync)."""
        module = self.engine.module if self.engine is not None else self.policy.model
        return {k: v.detach().to("cpu") for k, v in module.state_dict().items()}

    def save(self, ckpt_dir: str, tag: str) -> str:
        """DeepSpeed checkpoint (model, optimizer, LR schedule) + the policy for eval; returns its folder.

        For an exact resume it also keeps, in DeepSpeed's ``client_state``, the learner's step count (it
        seeds the ``coupled`` estimator's masks, :func:`estimator_seed`) and the torch / numpy / python RNG
        states; and, with ``rl.beta > 0``, the frozen KL reference (``reference.pt``): it is the
        warm-started policy, which a resumed learner no longer has (it loads the RL weights instead).
        """
        client_state = {"dice_ray": {"step_count": self.step_count, "rng": _rng_state()}}
        self.engine.save_checkpoint(ckpt_dir, tag=tag, client_state=client_state)
        if self.rank == 0:
            self.policy.save(os.path.join(ckpt_dir, tag, "policy"))
            if self.ref_model is not None:
                torch.save(self.ref_model.state_dict(), os.path.join(ckpt_dir, tag, "reference.pt"))
        return os.path.join(ckpt_dir, tag)

    def load(self, ckpt_dir: str, tag: str) -> None:
        """Restore a checkpoint written by :meth:`save` (after :meth:`init_engine`): weights, optimizer,
        LR schedule, step count, RNG states and the KL reference.

        Raises:
            FileNotFoundError: no checkpoint ``tag`` under ``ckpt_dir``, or its KL reference is missing
                while ``rl.beta > 0``.
        """
        path, client_state = self.engine.load_checkpoint(ckpt_dir, tag=tag)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint {tag!r} under {ckpt_dir}")
        extra = (client_state or {}).get("dice_ray")
        if extra is not None:  # checkpoints of older dice-ray versions lack it: step count 0, RNG as is
            self.step_count = extra["step_count"]
            _set_rng_state(extra["rng"])
        if self.ref_model is not None:
            ref = os.path.join(ckpt_dir, tag, "reference.pt")
            if not os.path.exists(ref):
                raise FileNotFoundError(f"rl.beta={self.cfg.rl.beta} needs the KL reference {ref}, which is missing")
            self.ref_model.load_state_dict(torch.load(ref, map_location=self.device, weights_only=True))


def _rng_state() -> dict:
    """The process's torch (CPU and, if present, CUDA), numpy and python RNG states."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    """Restore what :func:`_rng_state` took (CUDA states only where CUDA is up)."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
