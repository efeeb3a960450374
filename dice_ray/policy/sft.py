"""Masked-diffusion SFT warm start of the policy, every family (:mod:`dice_ray.policy.families`).

Each training example is a (prompt, target) pair (LLaDA / Dream infilling: a (before, middle, after) triple, the
middle its target, see below); the target gets ``<|eos|>`` appended and is padded with
``<|eos|>`` to a multiple of ``block_size`` (the sampler stops after the block holding ``<|eos|>``). The loss
depends on the family, chosen in one place (:func:`diffusion_loss`); the rest of the loop is shared.

* SDAR (block diffusion, SDAR / BD3-LM training): one pass uses BD3-LM's ``x_t ‖ x_0`` layout (see
  :mod:`dice_ray.policy.model`): the prompt (one bidirectional block) and the clean response are encoded
  block-causally, then a noisy copy of the response attends them. In the noisy copy every block hides its own
  random number ``k ~ U{1..block_size}`` of tokens (random positions) behind ``<|mask|>``; with
  ``complementary_mask`` a second noisy copy hides exactly the other tokens of each block (DiffuCoder's coupled
  sampling), so every response token is a target once a step. Loss: cross-entropy of the masked tokens, **mean
  over masked tokens** of the batch (no 1/t ELBO weight as in BD3-LM / MDLM: the warm start only has to make the
  policy reproduce its targets, and the plain mean is the steadier objective for that).
* LLaDA / Dream (fully bidirectional): LLaDA's SFT objective (Nie et al. 2025, arXiv 2502.09992, eq. 3 and its SFT
  section; :func:`masked_diffusion_loss`): per item ``t ~ U(eps, 1]`` (:data:`MASK_EPS`), each response token
  masked with probability ``t``, the prompt clean, one forward of ``prompt ‖ noisy response`` with full
  attention (padding keys never attended), cross-entropy of the masked tokens weighted ``1 / t`` and divided by
  the response length, mean over the batch's items (an unbiased estimate of the mean per-token cross-entropy over
  masking levels, so ``target_loss`` reads on the same scale). Dream's logits are read one position to the left.
  ``complementary_mask``: a second copy masks exactly the other tokens (ratio ``1 - t``, weight ``1 / (1 - t)``,
  ``t`` then drawn from ``U(eps, 1 - eps)``), the two copies averaged. Infilling in place: a
  ``(before, middle, after)`` triple (:func:`dice_ray.tasks.prompts.sft_pairs` for ``"llada"`` / ``"dream"``) trains
  the middle in the layout the sampler infills in (:func:`dice_ray.policy.sampler.infill_group`):
  ``before ‖ noisy middle ‖ after`` with full attention, the loss on the masked middle tokens only, ``after`` clean
  as the prompt is. SDAR keeps the scaffold in its prompt and trains ``(prompt, middle)`` pairs.

Optimiser: AdamW (betas 0.9, 0.98), gradient-norm clipping, linear warm-up
and cosine decay to ``min_lr_ratio`` (a ``LambdaLR``), ``gradient_accumulation_steps`` batches a step.

The loop is :class:`SFTRun`, a resumable state (weights, AdamW moments, lr schedule, data order, mask RNG),
stepped by plain torch or through a one-process DeepSpeed engine. Two callers:

* :func:`warm_start`, the trainer's warm start (inside the Learner actor, before its DeepSpeed engine), on
  the plain torch path: the learner joins its own ``torch.distributed`` group (its world size, its backend)
  only afterwards, in ``Learner.init_engine``, and DeepSpeed keeps the groups it saw for the life of the
  process, so a one-rank group made here could be neither replaced nor torn down. Results are cached under
  ``cfg.cache_dir / <key>`` where the key hashes the pairs, the model config, the tokenizer, the initial
  weights, the SFT config (less bookkeeping and engine-only fields) and the seed; a second call with the same
  inputs loads the weights instead of training.
* :func:`run_sft`, ``dice-ray sft`` / ``jobs/sft.py``: the same training on a task spec's pairs as a command
  (one process, world size 1) through a DeepSpeed engine (ZeRO stage ``sft.zero_stage``, bf16 when
  ``model.dtype`` is bfloat16; gloo on CPU, NCCL on GPU), with DeepSpeed checkpoints, ``--resume`` and per-step
  metrics; its output folder is a saved policy (:meth:`DiffusionPolicy.save`) that
  ``dice-ray train model.path=OUT`` starts RL from. At ZeRO stage 0 in float32 its weights equal the warm
  start's for the same pairs, config and seed, bit for bit (DeepSpeed's fp32 clipping and one-rank gradient
  all-reduce change no value; the tests check it).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager, redirect_stdout
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_model, save_model

from dice_ray.config import DEEPSPEED_OPS_DIR, DiceConfig, SFTConfig, load_config
from dice_ray.policy.logprobs import BIDIRECTIONAL
from dice_ray.policy.model import KVCache, block_mask, forward_hidden, prompt_blocks, token_logits
from dice_ray.policy.policy import DiffusionPolicy
from dice_ray.policy.sampler import span_hidden

SFT_VERSION = "3"  # bump when the training recipe changes: old cache entries stop matching
# fields that do not change the warm start's weights (zero_stage only picks dice-ray sft's engine; seed is hashed as
# the seed in effect, DiceConfig.sft_seed)
_BOOKKEEPING = {"enabled", "cache_dir", "num_threads", "log_every", "checkpoint_every", "zero_stage", "seed"}
MASK_EPS = 1e-3
"""LLaDA's lower bound of the mask ratio ``t`` of the bidirectional families' SFT (the ``1 / t`` weight <= 1000)."""


@dataclass
class SFTReport:
    """What :func:`warm_start` did.

    Attributes:
        steps: optimizer steps taken (fewer than ``cfg.steps`` when ``target_loss`` stopped it early;
            0 on a cache hit or when disabled).
        final_loss: the SFT loss (nats a token: SDAR's mean masked-token cross-entropy, LLaDA / Dream's 1/t-weighted
            one, see the module doc) over the last logged window, as trained (also on a cache hit); NaN when
            nothing was trained.
        seconds: wall time of the call (s).
        cache_hit: True when the weights came from the cache.
        cache_key: the content hash naming the cache entry.
        num_pairs: training pairs.
        losses: ``(step, mean loss of the window ending there)`` every ``log_every`` steps.
    """

    steps: int
    final_loss: float
    seconds: float
    cache_hit: bool
    cache_key: str = ""
    num_pairs: int = 0
    losses: list[tuple[int, float]] = field(default_factory=list)


def tokenize_pairs(policy: DiffusionPolicy, pairs: list[tuple[str, ...]]) -> list[tuple[list[int], ...]]:
    """Token ids of (prompt, target) pairs and (LLaDA / Dream) (before, middle, after) infill triples.

    Items keep their pair's shape: ``(prompt_ids, target_ids)`` or ``(before_ids, middle_ids, after_ids)``. Targets
    (middles) end with ``<|eos|>``, padded with it to whole blocks; ``after`` is encoded as it is (may be empty).

    Raises:
        ValueError: a pair of neither 2 nor 3 texts, a triple for SDAR (it keeps the scaffold in its prompt), an empty
            prompt, or prompt + target (+ after) longer than ``max_position_embeddings``.
    """
    out = []
    bs, limit = policy.block_size, policy.model_cfg.max_position_embeddings
    for i, pair in enumerate(pairs):
        if len(pair) not in (2, 3):
            raise ValueError(f"pairs[{i}]: must be (prompt, target) or, LLaDA / Dream, (before, middle, after); "
                             f"got {len(pair)} texts")
        if len(pair) == 3 and policy.family not in BIDIRECTIONAL:
            raise ValueError(f"pairs[{i}]: a (before, middle, after) triple infills in place, for LLaDA / Dream; SDAR "
                             "keeps the scaffold in its prompt: pass (prompt, middle)")
        p = policy.encode(pair[0])
        t = policy.encode(pair[1]) + [policy.eos_id]
        t += [policy.eos_id] * (-len(t) % bs)
        after = [policy.encode(pair[2])] if len(pair) == 3 else []
        if not p:
            raise ValueError(f"pairs[{i}]: the prompt is empty")
        if len(p) + len(t) + sum(map(len, after)) > limit:
            also = f" + {len(after[0])} after" if after else ""
            raise ValueError(
                f"pairs[{i}]: {len(p)} prompt + {len(t)} target{also} tokens exceed max_position_embeddings={limit}"
            )
        out.append((p, t, *after))
    return out


def sft_cache_key(policy: DiffusionPolicy, pairs: list[tuple[str, ...]], cfg: SFTConfig, seed: int) -> str:
    """sha256 (hex, 24 chars) of everything that decides the warm-started weights (a list of 2-tuple pairs hashes as
    it always has; a triple hashes as its three texts)."""
    h = hashlib.sha256()
    cfg_part = cfg.model_dump(exclude=_BOOKKEEPING)
    model_part = policy.model_cfg.model_dump(exclude={"path"})
    h.update(json.dumps([SFT_VERSION, cfg_part, model_part, seed, pairs], sort_keys=True).encode())
    h.update(hashlib.sha256(policy.tokenizer.to_json().encode()).digest())
    for name, t in sorted(policy.model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:24]


def _collate(items: list[tuple[list[int], list[int]]], pad_id: int, device: torch.device):
    B = len(items)
    P = torch.tensor([len(p) for p, _ in items], device=device)
    R = torch.tensor([len(t) for _, t in items], device=device)
    Pm, Rm = int(P.max()), int(R.max())
    prompt = torch.full((B, Pm), pad_id, dtype=torch.long, device=device)
    resp = torch.full((B, Rm), pad_id, dtype=torch.long, device=device)
    for i, (p, t) in enumerate(items):
        prompt[i, : len(p)] = torch.tensor(p, device=device)
        resp[i, : len(t)] = torch.tensor(t, device=device)
    valid = torch.arange(Rm, device=device)[None] < R[:, None]
    return prompt, resp, P, valid


def masked_diffusion_loss(
    policy: DiffusionPolicy,
    items: list[tuple[list[int], ...]],
    masks: list[torch.Tensor],
    t: torch.Tensor,
) -> torch.Tensor:
    """Per-item masked-diffusion SFT loss of a bidirectional policy (LLaDA / Dream) for given masks and ratios.

    LLaDA's SFT objective (Nie et al. 2025, arXiv 2502.09992, eq. 3 and its SFT section; ``GSAI-ML/LLaDA``'s
    guidelines): item ``i``'s row is ``prompt ‖ noisy response`` (the response's ``masks[i]`` positions replaced
    by ``<|mask|>``, the prompt clean), or ``before ‖ noisy middle ‖ after`` for an infill triple (``after`` clean,
    never scored: the sampler's infilling layout), one forward with full attention (padding keys of the batch never
    attended: :func:`dice_ray.policy.sampler.span_hidden`, which also reads Dream's logits one position to the
    left, :func:`~dice_ray.policy.families.logit_shift`; only the masked positions are projected to logits); the loss is
    ``sum over masked j of CE(logits_j, target_j) / t_i``, divided by the response length ``len(target_i)``.
    An item's value does not depend on the other items of the batch.

    Args:
        items: ``(prompt_ids, target_ids)`` or ``(before_ids, middle_ids, after_ids)``, non-empty prompts (Dream
            reads the first target from the last prompt position).
        masks: BoolTensor[len(target_i)] per item (True: masked; any device).
        t: FloatTensor[B], each item's mask ratio in (0, 1] (the ``1 / t`` weight).

    Returns:
        FloatTensor[B] (fp32, differentiable): each item's loss (nats a response token).

    Raises:
        ValueError: the policy is SDAR (block diffusion: :func:`diffusion_loss`), or ``masks`` / ``t`` do not match
            ``items`` (count, lengths), or a ``t`` outside (0, 1].
    """
    if policy.family not in BIDIRECTIONAL:
        raise ValueError(f"policy: masked_diffusion_loss needs family in {BIDIRECTIONAL}, got {policy.family!r}")
    if len(masks) != len(items) or t.shape != (len(items),):
        raise ValueError(f"masks ({len(masks)}) and t {tuple(t.shape)}: need one per item ({len(items)})")
    if any(m.shape != (len(r),) for m, (_, r, *_) in zip(masks, items)):
        raise ValueError("masks: masks[i] must be a BoolTensor of len(target_i) entries")
    if not bool(((t > 0) & (t <= 1)).all()):
        raise ValueError(f"t: mask ratios must lie in (0, 1], got {t.tolist()}")
    device, mask_id = policy.device, policy.mask_id
    rows, starts, lengths = [], [], []
    for (p, r, *after), m in zip(items, masks):
        resp = torch.tensor(r, dtype=torch.long, device=device)
        noisy = torch.where(m.to(device), torch.full_like(resp, mask_id), resp)
        rows.append(torch.cat([torch.tensor(p, dtype=torch.long, device=device), noisy,
                               torch.tensor(after[0] if after else [], dtype=torch.long, device=device)]))
        starts.append(len(p))
        lengths.append(len(r))
    h = span_hidden(policy.model, rows, starts, lengths, policy.logit_shift, policy.pad_id)  # [B, S, H], shifted
    S = h.shape[1]
    sel = torch.zeros(len(items), S, dtype=torch.bool, device=device)
    target = torch.zeros(len(items), S, dtype=torch.long, device=device)
    for i, ((_, r, *_), m) in enumerate(zip(items, masks)):
        sel[i, : len(r)] = m.to(device)
        target[i, : len(r)] = torch.tensor(r, dtype=torch.long, device=device)
    ce = F.cross_entropy(token_logits(policy.model, h[sel], mask_id), target[sel], reduction="none")  # [n_masked]
    weight = 1.0 / (t.to(device).float() * torch.tensor(lengths, dtype=torch.float32, device=device))  # [B]
    row = sel.nonzero()[:, 0]
    return torch.zeros(len(items), dtype=torch.float32, device=device).index_add(0, row, ce * weight[row])


def _bidirectional_loss(
    policy: DiffusionPolicy, items: list[tuple[list[int], ...]], generator: torch.Generator, complementary: bool
) -> tuple[torch.Tensor, int]:
    """:func:`diffusion_loss` for LLaDA / Dream: draw ``t`` and the masks item by item, then
    :func:`masked_diffusion_loss` (both copies in one forward), mean over the items (and the two copies)."""
    hi = 1.0 - MASK_EPS if complementary else 1.0  # the complement's ratio 1 - t stays >= eps too
    ts, masks = [], []
    for _, r, *_ in items:  # item by item: a batch draws what its items draw one after another
        t = MASK_EPS + (hi - MASK_EPS) * torch.rand((), generator=generator)
        masks.append(torch.rand(len(r), generator=generator) < t)
        ts.append(t)
    t = torch.stack(ts)
    if complementary:
        items, masks, t = items + items, masks + [~m for m in masks], torch.cat([t, 1.0 - t])
    loss = masked_diffusion_loss(policy, items, masks, t).mean()
    return loss, int(sum(int(m.sum()) for m in masks))


def diffusion_loss(
    policy: DiffusionPolicy,
    items: list[tuple[list[int], ...]],
    generator: torch.Generator,
    complementary: bool = True,
) -> tuple[torch.Tensor, int]:
    """Masked-diffusion SFT loss of a batch for the policy's family (see the module doc).

    SDAR: masked block-diffusion cross-entropy, BD3-LM's ``x_t ‖ x_0`` layout, every block hiding
    ``k ~ U{1..block_size}`` tokens, mean over the masked tokens. LLaDA / Dream: LLaDA's SFT loss
    (:func:`masked_diffusion_loss`) with ``t ~ U(eps, 1]`` per item (``eps`` = :data:`MASK_EPS`; with
    ``complementary`` ``t ~ U(eps, 1 - eps)``), each response token masked with probability ``t``, mean over
    the items.

    Args:
        items: ``(prompt_ids, target_ids)``, targets a multiple of ``block_size`` long (SDAR); LLaDA / Dream also
            ``(before_ids, middle_ids, after_ids)`` infill triples (:func:`masked_diffusion_loss`).
        generator: CPU torch.Generator drawing the masks (and ``t``).
        complementary: add the complementary noisy copy (DiffuCoder coupled sampling; LLaDA / Dream: weighted
            ``1 / (1 - t)``, the two copies averaged).

    Returns:
        (scalar fp32 loss, differentiable; number of masked target tokens).

    Raises:
        ValueError: an SDAR batch holding an infill triple (SDAR keeps the scaffold in its prompt).
    """
    if getattr(policy, "family", "sdar") in BIDIRECTIONAL:
        return _bidirectional_loss(policy, items, generator, complementary)
    if any(len(it) != 2 for it in items):
        raise ValueError("items: SDAR trains (prompt_ids, target_ids) pairs; it keeps the scaffold in its prompt")
    model, bs, mask_id = policy.model, policy.block_size, policy.mask_id
    device = policy.device
    prompt, resp, P, valid = _collate(items, policy.pad_id, device)
    B, Pm = prompt.shape
    Rm = resp.shape[1]
    nb = Rm // bs

    # per block: k ~ U{1..bs} masked tokens at random positions
    k = torch.randint(1, bs + 1, (B, nb, 1), generator=generator)
    rank = torch.rand((B, nb, bs), generator=generator).argsort(-1).argsort(-1)
    masks = [(rank < k).view(B, Rm).to(device)]
    if complementary:
        masks.append(~masks[0])
    C = len(masks)

    ar_p, ar_r = torch.arange(Pm, device=device), torch.arange(Rm, device=device)
    p_valid = ar_p[None] < P[:, None]  # [B, Pm] real prompt keys
    rb = ar_r // bs + 1
    zp, zr = torch.zeros_like(ar_p), torch.zeros_like(ar_r)
    p_block = prompt_blocks(P, bs)  # [B, Pm]: each row's prompt block-causal, blocks aligned to its own end
    p_mask = p_valid[:, None, :] & (p_block[:, None, :] <= p_block[:, :, None])
    cache = KVCache()
    forward_hidden(model, prompt, ar_p, p_mask, cache)
    k_block = torch.cat([zp, rb])
    m_clean = block_mask(rb, zr, k_block, torch.zeros_like(k_block))[None] & torch.cat(
        [p_valid, valid.new_ones(B, Rm)], 1
    )[:, None, :]
    pos = P[:, None] + ar_r[None]
    forward_hidden(model, resp, pos, m_clean, cache)

    q_block = rb.repeat(C)
    q_copy = torch.arange(1, C + 1, device=device).repeat_interleave(Rm)
    m_noisy = block_mask(q_block, q_copy, torch.cat([k_block, q_block]), torch.cat([torch.zeros_like(k_block), q_copy]))
    m_noisy = m_noisy[None] & torch.cat([p_valid, valid.new_ones(B, Rm + C * Rm)], 1)[:, None, :]
    noisy = torch.cat([torch.where(m, torch.full_like(resp, mask_id), resp) for m in masks], 1)
    h = forward_hidden(model, noisy, pos.repeat(1, C), m_noisy, cache, keep=0)
    sel = torch.cat(masks, 1) & valid.repeat(1, C)
    logits = token_logits(model, h[sel], mask_id)
    loss = F.cross_entropy(logits, resp.repeat(1, C)[sel])
    return loss, int(sel.sum())


def length_batches(costs: list[int], batch_size: int, generator: torch.Generator) -> list[list[int]]:
    """One epoch of batches of similar cost ("sortish" sampling: less padding, still random).

    Shuffles the indices, sorts each run of ``4 * batch_size`` by cost, cuts it into batches and shuffles
    the batch order. Every index appears exactly once.
    """
    perm = torch.randperm(len(costs), generator=generator).tolist()
    chunk = 4 * batch_size
    batches = []
    for i in range(0, len(perm), chunk):
        run = sorted(perm[i : i + chunk], key=lambda j: costs[j])
        batches += [run[k : k + batch_size] for k in range(0, len(run), batch_size)]
    order = torch.randperm(len(batches), generator=generator).tolist()
    return [batches[i] for i in order]


def _lr_at(step: int, cfg: SFTConfig) -> float:
    """The lr of optimizer step ``step`` (0-based): linear warm-up, then cosine decay to ``min_lr_ratio``."""
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
    return cfg.learning_rate * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cos)


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """Scale gradients in place so that their joint L2 norm is at most ``max_norm``; returns the norm before.

    The arithmetic of DeepSpeed's fp32 ``deepspeed.runtime.utils.clip_grad_norm_`` (per-tensor norms,
    squared and summed, square root; coefficient ``min(1, max_norm / (norm + 1e-6))``), not
    ``torch.nn.utils.clip_grad_norm_``'s (same value up to rounding): the plain path then takes the very steps
    of ``dice-ray sft``'s ZeRO-0 float32 engine.

    Args:
        parameters: iterable of tensors; those with a ``.grad`` are clipped (any float dtype).
        max_norm: the cap (> 0).

    Returns:
        fp32 tensor [] or [1]: the joint norm before clipping (0 when no gradient).
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    total = torch.stack([g.detach().float().norm(2.0) for g in grads]).pow(2.0).sum().float().pow(0.5)
    coef = torch.min(torch.tensor([1.0]).to(total.device),
                     torch.tensor([float(max_norm)]).to(total.device) / (total + 1e-6))
    for g in grads:
        g.detach().mul_(coef)
    return total


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def deepspeed_initialize(**kwargs: Any) -> tuple[Any, ...]:
    """``deepspeed.initialize(**kwargs)``, on a CPU accelerator without DeepSpeed's shared-memory collective op
    (:func:`_skip_shm_comm_op`: no JIT build at a machine's first run).

    Returns:
        what ``deepspeed.initialize`` returns (engine, optimizer, dataloader, scheduler).
    Raises:
        whatever ``deepspeed.initialize`` raises.
    """
    import deepspeed

    _skip_shm_comm_op()
    return deepspeed.initialize(**kwargs)


def _skip_shm_comm_op() -> None:
    """On DeepSpeed's CPU accelerator, mark its shared-memory collective op (``deepspeed_shm_comm``) unavailable,
    so its communication backend reduces through ``torch.distributed`` (gloo) instead of JIT-building the op at
    the first ``deepspeed.initialize`` of a machine: 30-50 s on a 2-core machine, the first run's longest wait.
    dice-ray's CPU learner and SFT are single-host, test-sized runs that gain nothing from it.  No effect on a GPU
    (NCCL).  DeepSpeed keeps the probed op table in ``deepspeed.ops.__compatible_ops__`` (edits persist)."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def init_single_process_group() -> str:
    """Make this process a one-rank ``torch.distributed`` group (gloo on CPU, NCCL on GPU) unless it is one.

    The group is kept for the life of the process: DeepSpeed caches the groups it was initialised with, so a
    destroyed and re-created group would break its next engine. Like ``Learner.init_engine`` it sets
    ``MASTER_ADDR`` / ``MASTER_PORT`` (a free local port) / ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``; like
    ``dice_ray.cluster.learner.learner_env`` (unless already set) ``DS_ACCELERATOR=cpu`` without a GPU and a
    persistent ``TORCH_EXTENSIONS_DIR`` (DeepSpeed's JIT ops, if any, build once per machine).

    Returns:
        the group's backend.

    Raises:
        RuntimeError: this process already belongs to a group of more than one rank.
    """
    import torch.distributed as dist

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser(DEEPSPEED_OPS_DIR))
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError(f"dice-ray sft trains in one process, but this process is rank {dist.get_rank()} "
                               f"of a torch.distributed group of {dist.get_world_size()}")
        return dist.get_backend()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    dist.init_process_group(backend, rank=0, world_size=1)
    return backend


def deepspeed_engine(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     scheduler: torch.optim.lr_scheduler.LRScheduler, cfg: SFTConfig, bf16: bool):
    """A one-process DeepSpeed engine around ``model`` with the client AdamW and lr schedule.

    ZeRO stage ``cfg.zero_stage``, ``gradient_clipping`` ``cfg.max_grad_norm``, ``gradient_accumulation_steps``
    as configured (``engine.backward`` divides each batch's loss by it; ``engine.step`` steps the optimizer and
    the scheduler at the accumulation boundary only), bf16 (fp32 master weights in DeepSpeed's optimizer) when
    ``bf16``. Joins (or makes) the one-rank group of :func:`init_single_process_group` first.

    Returns:
        the ``deepspeed.DeepSpeedEngine`` (its module is ``model``, moved to the accelerator).

    Raises:
        RuntimeError: this process belongs to a group of more than one rank.
    """
    init_single_process_group()
    ds_config = {
        "train_micro_batch_size_per_gpu": cfg.batch_size,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "gradient_clipping": cfg.max_grad_norm,
        "zero_optimization": {"stage": cfg.zero_stage},
        "bf16": {"enabled": bf16},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed_initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
    return engine


class SFTRun:
    """One masked-diffusion SFT run (any family) as a resumable state: weights, AdamW moments, lr schedule, data
    order, mask RNG.

    :func:`warm_start` (the trainer's warm start, plain torch) and ``dice-ray sft`` (:func:`run_sft`, through a
    DeepSpeed engine) both step it. One generator, seeded with ``seed``, draws the epochs' batch orders
    (:func:`length_batches`) and the masks (:func:`diffusion_loss`); a run restored from :meth:`save` (or,
    plain torch only, :meth:`state_dict`) takes the same steps (bit for bit on the same machine and thread
    count) as one that never stopped.

    Args:
        policy: trained in place (its model is put in train mode by :meth:`train_step`).
        pairs: (prompt, target) texts, or (LLaDA / Dream) (before, middle, after) infill triples.
        cfg: steps, batch size, accumulation, AdamW and schedule (see :class:`~dice_ray.config.SFTConfig`).
        seed: seed of the data order and the masks.
        use_deepspeed: step through :func:`deepspeed_engine` (ZeRO stage ``cfg.zero_stage``, bf16 when the
            policy's ``model_cfg.dtype`` is bfloat16; makes this process a one-rank ``torch.distributed``
            group). False: plain ``torch.optim.AdamW`` with ``torch.nn.utils.clip_grad_norm_``.

    Attributes:
        step: optimizer steps taken.
        stopped: ``cfg.target_loss`` was reached (the run ends before ``cfg.steps``).
        losses: ``(step, mean loss of the window ending there)`` every ``cfg.log_every`` steps.
        engine: the DeepSpeed engine, or None on the plain path.

    Raises:
        ValueError: ``pairs`` is empty or a pair is too long (see :func:`tokenize_pairs`).
        RuntimeError: ``use_deepspeed`` in a process that belongs to a group of more than one rank.
    """

    def __init__(self, policy: DiffusionPolicy, pairs: list[tuple[str, ...]], cfg: SFTConfig, seed: int,
                 use_deepspeed: bool = False):
        if not pairs:
            raise ValueError("pairs: need at least one (prompt, target) pair")
        self.policy, self.cfg = policy, cfg
        self.items = tokenize_pairs(policy, pairs)
        self._costs = [len(p) + 3 * len(t) + sum(map(len, after)) for p, t, *after in self.items]
        self.gen = torch.Generator().manual_seed(seed)
        self.opt = torch.optim.AdamW(policy.model.parameters(), lr=cfg.learning_rate, betas=(0.9, 0.98),
                                     weight_decay=cfg.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: _lr_at(s, cfg) / cfg.learning_rate)
        self.engine = None
        if use_deepspeed:
            bf16 = policy.model_cfg.dtype == "bfloat16"
            self.engine = deepspeed_engine(policy.model, self.opt, self.sched, cfg, bf16)
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
            loss, _ = diffusion_loss(self.policy, batch, self.gen, cfg.complementary_mask)
            if engine is not None:
                engine.backward(loss)  # divides by gradient_accumulation_steps
                engine.step()  # clip, AdamW and schedule at the accumulation boundary only
            else:
                (loss / accum).backward()
            total += loss.item()
            tokens += sum(sum(map(len, item)) for item in batch)
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
            self.engine.save_checkpoint(str(folder), tag=_DS_TAG, save_latest=False)
        torch.save({**(extra or {}), **self.state_dict()}, folder / _STATE_FILE)

    def load(self, folder: Path) -> dict:
        """Restore a run written by :meth:`save` on the same path (plain / DeepSpeed, same ZeRO stage).

        Returns:
            the ``extra`` entries :meth:`save` was given.

        Raises:
            FileNotFoundError: the folder lacks ``sft_state.pt`` or (with DeepSpeed) the engine checkpoint.
        """
        state = torch.load(folder / _STATE_FILE, map_location="cpu", weights_only=True)
        if self.engine is not None:
            if not (folder / _DS_TAG).is_dir():
                raise FileNotFoundError(f"{folder}: no DeepSpeed checkpoint {_DS_TAG}/ (a run of another engine)")
            path, _ = self.engine.load_checkpoint(str(folder), tag=_DS_TAG, load_optimizer_states=True,
                                                  load_lr_scheduler_states=True)
            if path is None:
                raise FileNotFoundError(f"{folder / _DS_TAG}: DeepSpeed could not load this checkpoint")
        self.load_state_dict(state)
        known = {"step", "stopped", "losses", "window", "batches", "ema", "generator", "model", "optimizer",
                 "scheduler"}
        return {k: v for k, v in state.items() if k not in known}


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


PROGRESS_EVERY_S = 30.0
"""The warm start's progress lines come every ``log_every`` steps or every this many seconds (s), whichever
is sooner: on loaded cores 50 steps can take minutes."""


def _progress_line(run: SFTRun, steps: int, elapsed_s: float, since_step1_s: float | None,
                   target_loss: float | None = None) -> str:
    """``warm start: step 120/800, loss 4.468 (step 100), 106 s, ~600 s left at this pace``: the loss is the last
    recorded window's (named when it is not this step's); the time left assumes every later step runs at the
    mean pace of the steps after the first (``since_step1_s``: seconds since step 1 ended; the set-up and the
    first step, slower, would inflate it), or of all steps so far when there are none yet (other load on the cores
    may slow the rest down). With a ``target_loss`` (``sft.target_loss``) the run usually stops sooner, so the line
    says ``at most ~600 s left at this pace (it stops at loss <= 0.1)``."""
    parts = [f"warm start: step {run.step}/{steps}"]
    if run.losses:
        at, loss = run.losses[-1]
        parts.append(f"loss {loss:.3f}" + ("" if at == run.step else f" (step {at})"))
    parts.append(f"{elapsed_s:.0f} s")
    if run.step:
        pace = since_step1_s / (run.step - 1) if since_step1_s is not None and run.step > 1 else elapsed_s / run.step
        left = f"~{pace * (steps - run.step):.0f} s left at this pace"
        parts.append(left if target_loss is None else f"at most {left} (it stops at loss <= {target_loss:g})")
    return ", ".join(parts)


@contextmanager
def _torch_threads(n: int | None):
    """torch CPU threads set to ``n`` (None: every core this process may use) for the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(n or len(os.sched_getaffinity(0)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def warm_start(policy: DiffusionPolicy, pairs: list[tuple[str, ...]], cfg: SFTConfig, seed: int,
               log: Callable[[str], None] | None = None) -> SFTReport:
    """Masked-diffusion SFT of ``policy`` (in place) on (prompt, target) pairs (LLaDA / Dream also (before,
    middle, after) infill triples, :func:`tokenize_pairs`), cached by content hash.

    The model is left in eval mode. With ``cfg.enabled`` False or ``cfg.steps == 0`` nothing is trained.
    Plain torch (no DeepSpeed, no ``torch.distributed`` group: it runs in the Learner actor before
    ``Learner.init_engine`` joins the learner's group, see the module doc); ``cfg.zero_stage`` is ignored.
    The weights equal those ``dice-ray sft`` (:func:`run_sft`) writes for the same pairs, config and seed at
    ``sft.zero_stage=0`` in float32.

    Args:
        log: called with a progress line every ``cfg.log_every`` steps or :data:`PROGRESS_EVERY_S`, whichever
            comes first (not on a cache hit).

    Returns:
        :class:`SFTReport` (steps, final loss, seconds, cache_hit).

    Raises:
        ValueError: ``pairs`` is empty or a pair is too long (see :func:`tokenize_pairs`).
    """
    t0 = time.perf_counter()
    if not pairs:
        raise ValueError("pairs: need at least one (prompt, target) pair")
    pairs = [tuple(str(x) for x in pair) for pair in pairs]
    if not cfg.enabled or cfg.steps == 0:
        return SFTReport(0, float("nan"), time.perf_counter() - t0, False, "", len(pairs))
    key = sft_cache_key(policy, pairs, cfg, seed)
    entry = Path(cfg.cache_dir).expanduser() / key
    if (entry / "model.safetensors").is_file() and (entry / "report.json").is_file():
        load_model(policy.model, str(entry / "model.safetensors"))
        policy.model.eval()
        saved = json.loads((entry / "report.json").read_text())
        return SFTReport(0, saved["final_loss"], time.perf_counter() - t0, True, key, len(pairs),
                         [tuple(x) for x in saved["losses"]])

    run = SFTRun(policy, pairs, cfg, seed)
    last_line, step1_end = t0, None
    try:
        with _torch_threads(cfg.num_threads):
            while not run.finished:
                run.train_step()
                now = time.perf_counter()
                step1_end = now if step1_end is None else step1_end
                # the last step's line is the caller's summary (an actor's line would reach the driver's
                # console after it)
                at_boundary = bool(run.losses) and run.losses[-1][0] == run.step
                if log is not None and not run.finished and (at_boundary or now - last_line >= PROGRESS_EVERY_S):
                    last_line = now
                    log(_progress_line(run, cfg.steps, now - t0, now - step1_end, cfg.target_loss))
    finally:
        policy.model.zero_grad(set_to_none=True)  # a cache hit leaves none either: RL must start the same
        policy.model.eval()
    model = policy.model
    final = run.losses[-1][1]
    steps_done = run.losses[-1][0]
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=f".{key}."))
    save_model(model, str(tmp / "model.safetensors"))
    report = SFTReport(steps_done, final, time.perf_counter() - t0, False, key, len(pairs), run.losses)
    (tmp / "report.json").write_text(json.dumps(asdict(report)))
    try:
        tmp.rename(entry)
    except OSError:  # another process wrote the same entry first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return report


# ---------------------------------------------------------------------------------------------
# dice-ray sft: the warm start as a command, resumable
# ---------------------------------------------------------------------------------------------

SFT_CONFIG_FILE = "sft_config.yaml"
SFT_METRICS_FILE = "sft_metrics.jsonl"
SFT_SUMMARY_FILE = "sft_summary.json"
_STATE_FILE = "sft_state.pt"
_DS_TAG = "ds"  # the DeepSpeed checkpoint's folder inside a checkpoint


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
    return sorted(ckpt.glob(f"step_*/{_STATE_FILE}")) if ckpt.is_dir() else []


def _save_checkpoint(run: SFTRun, out: Path, key: str, keep: int) -> Path:
    """``out/checkpoints/step_NNNNNN/`` (:meth:`SFTRun.save`, written to a temporary folder and renamed);
    older ones beyond ``keep`` deleted."""
    ckpt = out / "checkpoints"
    ckpt.mkdir(parents=True, exist_ok=True)
    final = ckpt / f"step_{run.step:06d}"
    tmp = Path(tempfile.mkdtemp(dir=ckpt, prefix=f".{final.name}."))
    run.save(tmp, {"key": key})
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in [p.parent for p in _checkpoints(out)][:-keep]:
        shutil.rmtree(old, ignore_errors=True)
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

    The same training as the trainer's warm start (:func:`warm_start` on the pairs of
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
        return _run_sft(data, out, config_path, overrides, resume, log)


def _run_sft(data, out, config_path, overrides, resume, log) -> dict:
    """:func:`run_sft`'s body (its stdout sent to stderr)."""
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
    if torch.cuda.is_available():
        policy.to("cuda")
    try:
        run = SFTRun(policy, pairs, cfg.sft, cfg.sft_seed, use_deepspeed=True)
    except ValueError as e:  # a pair too long for the model
        raise SFTInputError(f"--data {data}: {e} (raise model.max_position_embeddings or cap tasks.max_tasks)") from None
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
        kept = [ln for ln in (metrics.read_text().splitlines() if metrics.exists() else [])
                if ln.strip() and json.loads(ln)["step"] <= run.step]
        metrics.write_text("".join(ln + "\n" for ln in kept))
    else:
        out.mkdir(parents=True, exist_ok=True)
        (out / SFT_CONFIG_FILE).write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        run_file.write_text(json.dumps({"data": data, "key": key, "pairs": len(pairs)}, indent=1))
        metrics.write_text("")

    log(f"training {policy.num_parameters()} parameters, {cfg.sft.steps} steps at most, batch {cfg.sft.batch_size}")
    with _torch_threads(cfg.sft.num_threads), metrics.open("a") as f:
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
    policy.save(out)
    summary = {
        "out": str(out), "data": data, "pairs": len(pairs), "steps": run.step,
        "final_loss": run.losses[-1][1] if run.losses else None, "stopped_early": run.stopped,
        "seconds": time.perf_counter() - t0, "resumed_from": resumed_from,
        "train_command": f"dice-ray train model.path={out}",
    }
    (out / SFT_SUMMARY_FILE).write_text(json.dumps(summary, indent=1))
    return summary
