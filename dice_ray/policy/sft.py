"""Masked-diffusion SFT warm start of the block-diffusion policy (SDAR / BD3-LM block diffusion training).

Each training example is a (prompt, target) pair; the target gets ``<|eos|>`` appended and is padded with
``<|eos|>`` to a multiple of ``block_size`` (the sampler stops after the block holding ``<|eos|>``).
One pass uses BD3-LM's ``x_t ‖ x_0`` layout (see :mod:`dice_ray.policy.model`): the prompt (one bidirectional
block) and the clean response are encoded block-causally, then a noisy copy of the response attends them.
In the noisy copy every block hides its own random number ``k ~ U{1..block_size}`` of tokens (random
positions) behind ``<|mask|>``; with ``complementary_mask`` a second noisy copy hides exactly the other
tokens of each block (DiffuCoder's coupled sampling), so every response token is a target once a step.

Loss: cross-entropy of the masked tokens, **mean over masked tokens** of the batch (no 1/t ELBO weight as
in BD3-LM / MDLM: the warm start only has to make the policy reproduce its targets, and the plain mean is
the steadier objective for that). Optimiser: AdamW, linear warm-up, cosine decay to ``min_lr_ratio``.

Results are cached under ``cfg.cache_dir / <key>`` where the key hashes the pairs, the model config, the
tokenizer, the initial weights, the SFT config (less bookkeeping fields) and the seed; a second call with
the same inputs loads the weights instead of training.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_model, save_model

from dice_ray.config import SFTConfig
from dice_ray.policy.model import KVCache, block_mask, forward_hidden, token_logits
from dice_ray.policy.policy import DiffusionPolicy

SFT_VERSION = "1"  # bump when the training recipe changes: old cache entries stop matching
_BOOKKEEPING = {"enabled", "cache_dir", "num_threads", "log_every"}


@dataclass
class SFTReport:
    """What :func:`warm_start` did.

    Attributes:
        steps: optimizer steps taken (fewer than ``cfg.steps`` when ``target_loss`` stopped it early;
            0 on a cache hit or when disabled).
        final_loss: mean masked-token cross-entropy (nats) over the last logged window, as trained
            (also on a cache hit); NaN when nothing was trained.
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


def tokenize_pairs(policy: DiffusionPolicy, pairs: list[tuple[str, str]]) -> list[tuple[list[int], list[int]]]:
    """Token ids of (prompt, target) pairs; targets end with ``<|eos|>``, padded with it to whole blocks.

    Raises:
        ValueError: an empty prompt, or prompt + target longer than ``max_position_embeddings``.
    """
    out = []
    bs, limit = policy.block_size, policy.model_cfg.max_position_embeddings
    for i, (prompt, target) in enumerate(pairs):
        p = policy.encode(prompt)
        t = policy.encode(target) + [policy.eos_id]
        t += [policy.eos_id] * (-len(t) % bs)
        if not p:
            raise ValueError(f"pairs[{i}]: the prompt is empty")
        if len(p) + len(t) > limit:
            raise ValueError(
                f"pairs[{i}]: {len(p)} prompt + {len(t)} target tokens exceed max_position_embeddings={limit}"
            )
        out.append((p, t))
    return out


def sft_cache_key(policy: DiffusionPolicy, pairs: list[tuple[str, str]], cfg: SFTConfig, seed: int) -> str:
    """sha256 (hex, 24 chars) of everything that decides the warm-started weights."""
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


def diffusion_loss(
    policy: DiffusionPolicy,
    items: list[tuple[list[int], list[int]]],
    generator: torch.Generator,
    complementary: bool = True,
) -> tuple[torch.Tensor, int]:
    """Masked block-diffusion cross-entropy of a batch (BD3-LM ``x_t ‖ x_0`` layout; see module doc).

    Args:
        items: ``(prompt_ids, target_ids)``, targets a multiple of ``block_size`` long.
        generator: CPU torch.Generator drawing the masks.
        complementary: add the complementary noisy copy (DiffuCoder coupled sampling).

    Returns:
        (scalar fp32 loss, mean over masked target tokens, differentiable; number of masked tokens).
    """
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
    cache = KVCache()
    forward_hidden(model, prompt, ar_p, p_valid[:, None, :].expand(B, Pm, Pm), cache)
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
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
    return cfg.learning_rate * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cos)


def warm_start(policy: DiffusionPolicy, pairs: list[tuple[str, str]], cfg: SFTConfig, seed: int) -> SFTReport:
    """Masked-diffusion SFT of ``policy`` (in place) on (prompt, target) pairs, cached by content hash.

    The model is left in eval mode. With ``cfg.enabled`` False or ``cfg.steps == 0`` nothing is trained.

    Returns:
        :class:`SFTReport` (steps, final loss, seconds, cache_hit).

    Raises:
        ValueError: ``pairs`` is empty or a pair is too long (see :func:`tokenize_pairs`).
    """
    t0 = time.perf_counter()
    if not pairs:
        raise ValueError("pairs: need at least one (prompt, target) pair")
    pairs = [(str(p), str(t)) for p, t in pairs]
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

    items = tokenize_pairs(policy, pairs)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(cfg.num_threads or len(os.sched_getaffinity(0)))
    gen = torch.Generator().manual_seed(seed)
    model = policy.model
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, betas=(0.9, 0.98),
                            weight_decay=cfg.weight_decay)
    losses: list[tuple[int, float]] = []
    window: list[float] = []
    batches: list[list[int]] = []
    ema: float | None = None
    try:
        for step in range(cfg.steps):
            if not batches:
                batches = length_batches([len(p) + 3 * len(t) for p, t in items], cfg.batch_size, gen)
            batch = batches.pop()
            for g in opt.param_groups:
                g["lr"] = _lr_at(step, cfg)
            loss, _ = diffusion_loss(policy, [items[i] for i in batch], gen, cfg.complementary_mask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            opt.step()
            window.append(loss.item())
            ema = window[-1] if ema is None else 0.9 * ema + 0.1 * window[-1]
            done = cfg.target_loss is not None and step >= 20 and ema < cfg.target_loss
            if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps or done:
                losses.append((step + 1, sum(window) / len(window)))
                window = []
            if done:
                break
    finally:
        torch.set_num_threads(threads_before)
        model.eval()
    final = losses[-1][1]
    steps_done = losses[-1][0]
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=f".{key}."))
    save_model(model, str(tmp / "model.safetensors"))
    report = SFTReport(steps_done, final, time.perf_counter() - t0, False, key, len(pairs), losses)
    (tmp / "report.json").write_text(json.dumps(asdict(report)))
    try:
        tmp.rename(entry)
    except OSError:  # another process wrote the same entry first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return report
