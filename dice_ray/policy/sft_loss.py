"""Masked-diffusion SFT losses, every family (:mod:`dice_ray.policy.families`); :func:`diffusion_loss` picks the
family's.

Each training example is a (prompt, target) pair (LLaDA / Dream infilling: a (before, middle, after) triple, the
middle its target, see below); the target gets ``<|eos|>`` appended and is padded with ``<|eos|>`` to a multiple of
``block_size`` (:func:`dice_ray.policy.sft_batches.tokenize_pairs`; the sampler stops after the block holding
``<|eos|>``). The loss depends on the family, chosen in one place (:func:`diffusion_loss`); the rest of the loop
(:class:`~dice_ray.policy.sft_run.SFTRun`) is shared.

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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dice_ray.policy.logprobs import BIDIRECTIONAL
from dice_ray.policy.model import KVCache, block_mask, forward_hidden, prompt_blocks, token_logits
from dice_ray.policy.policy import DiffusionPolicy
from dice_ray.policy.sampler import span_hidden

MASK_EPS = 1e-3
"""LLaDA's lower bound of the mask ratio ``t`` of the bidirectional families' SFT (the ``1 / t`` weight <= 1000)."""


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


def _shard_rows(batch: int, shard: tuple[int, int]) -> tuple[list[int], float]:
    """Rank ``r`` of ``w``'s rows of a batch of ``batch`` items (``r, r + w, ...``) and its loss weight: 1, or 0 for a
    rank with no row (it runs row 0 at weight 0, so that it still takes part in the gradient all-reduce)."""
    rank, world = shard
    rows = list(range(rank, batch, world))
    return (rows, 1.0) if rows else ([0], 0.0)


def _bidirectional_loss(
    policy: DiffusionPolicy, items: list[tuple[list[int], ...]], generator: torch.Generator, complementary: bool,
    shard: tuple[int, int] | None = None,
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
    scale = None
    if shard is not None:  # every item drawn above (the same draws on every rank); this rank's items scored
        rows, weight = _shard_rows(len(items), shard)
        scale = weight * shard[1] / (len(items) * (2 if complementary else 1))
        items, masks, t = [items[i] for i in rows], [masks[i] for i in rows], t[rows]
    if complementary:
        items, masks, t = items + items, masks + [~m for m in masks], torch.cat([t, 1.0 - t])
    per_item = masked_diffusion_loss(policy, items, masks, t)
    loss = per_item.mean() if scale is None else per_item.sum() * scale
    return loss, int(sum(int(m.sum()) for m in masks))


def diffusion_loss(
    policy: DiffusionPolicy,
    items: list[tuple[list[int], ...]],
    generator: torch.Generator,
    complementary: bool = True,
    shard: tuple[int, int] | None = None,
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
        shard: ``(rank, world_size)`` of a data-parallel group: the masks (and ``t``) are drawn for the whole
            batch, as one rank draws them, but only this rank's items (``rank, rank + world_size, ...``) run; the
            loss is their share of the batch's loss times ``world_size``, so the mean of the ranks' gradients (what
            DeepSpeed's all-reduce takes) is the one-rank gradient of the whole batch. None: the whole batch.

    Returns:
        (scalar fp32 loss, differentiable; number of masked target tokens, this rank's with ``shard``).

    Raises:
        ValueError: an SDAR batch holding an infill triple (SDAR keeps the scaffold in its prompt).
    """
    if getattr(policy, "family", "sdar") in BIDIRECTIONAL:
        return _bidirectional_loss(policy, items, generator, complementary, shard)
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
    scale = None
    if shard is not None:  # masks drawn for the whole batch above; this rank's rows run, the batch's mean kept
        n_all = int((torch.cat(masks, 1) & valid.repeat(1, C)).sum())
        rows, weight = _shard_rows(B, shard)
        scale = weight * shard[1] / max(n_all, 1)
        idx = torch.tensor(rows, device=device)
        P, resp, valid, masks = P[idx], resp[idx], valid[idx], [m[idx] for m in masks]
        B, Pm = len(rows), int(P.max())
        prompt = prompt[idx, :Pm]  # these rows' prompt padding (never attended)

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
    if scale is None:
        loss = F.cross_entropy(logits, resp.repeat(1, C)[sel])
    else:
        loss = F.cross_entropy(logits, resp.repeat(1, C)[sel], reduction="sum") * scale
    return loss, int(sel.sum())
