"""TraceRL per-step log-probs of sampled responses (Wang et al. 2025, TraceRL; DICE's RL estimator).

A rollout records, for each response token, the denoising step ``s`` (within its block) at which the
sampler unmasked it. The policy's log-prob of the token is taken in the state the sampler saw: every
block's partially masked copy with the tokens unmasked before step ``s`` visible (``unmask_step < s``) and
the rest ``<|mask|>``, attending the clean earlier blocks and the prompt.

All blocks are scored at once with BD3-LM's / SDAR's ``x_t ‖ x_0`` layout (see :mod:`dice_ray.policy.model`):
the prompt and clean response are encoded once (block-causal, keys/values kept with their autograd history);
then one pass per step index ``s`` (at most ``block_size`` passes) runs the noisy response of step ``s`` with
the same position ids; noisy block ``b`` sees the prompt, clean blocks ``< b`` and itself. This equals one
``[prompt, clean, noisy_s]`` forward with the x_t ‖ x_0 mask, without recomputing the prompt and clean
part for every ``s``.
"""

from __future__ import annotations

import torch

from dice_ray.policy.model import KVCache, block_mask, forward_hidden, response_blocks, token_logits


def tracerl_logprobs(
    model,
    prompt_ids: torch.Tensor,
    response_ids: torch.Tensor,
    unmask_step: torch.Tensor,
    response_mask: torch.Tensor,
    block_size: int,
    mask_id: int,
) -> torch.Tensor:
    """Per-token log-probs of a group's responses in the denoising states that produced them (TraceRL).

    Args:
        model: the policy's Qwen3ForCausalLM (``dice_block`` attention); train or eval mode, grads flow.
        prompt_ids: LongTensor[P], the shared prompt of the group.
        response_ids: LongTensor[G, R], R a multiple of ``block_size`` (rows padded with whole blocks).
        unmask_step: LongTensor[G, R], 0-based denoising step within its block at which each token was
            unmasked. Tokens not scored but inside a scored block (e.g. after ``<|eos|>``) must still carry
            their real step: they are part of the state other tokens were drawn in. Padding blocks: any value.
        response_mask: BoolTensor[G, R], True for the tokens to score (padding False).
        block_size: tokens a block.
        mask_id: id of ``<|mask|>``.

    Returns:
        FloatTensor[G, R] (fp32) log p(token | state at its step); 0 where ``response_mask`` is False.
        Differentiable w.r.t. the model parameters.

    Raises:
        ValueError: shapes disagree, R is not a multiple of ``block_size``, or a scored ``unmask_step`` is
            outside ``[0, block_size)``.
    """
    if prompt_ids.dim() != 1 or prompt_ids.numel() == 0:
        raise ValueError(f"prompt_ids: must be a non-empty 1-D LongTensor, got shape {tuple(prompt_ids.shape)}")
    if response_ids.dim() != 2:
        raise ValueError(f"response_ids: must be [G, R], got shape {tuple(response_ids.shape)}")
    for name, t in (("unmask_step", unmask_step), ("response_mask", response_mask)):
        if t.shape != response_ids.shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)} must equal response_ids {tuple(response_ids.shape)}")
    response_mask = response_mask.bool()
    if response_mask.any():
        scored = unmask_step[response_mask]
        if scored.min() < 0 or scored.max() >= block_size:
            raise ValueError(f"unmask_step: scored values must lie in [0, {block_size}), got "
                             f"[{int(scored.min())}, {int(scored.max())}]")
    device = next(model.parameters()).device
    prompt_ids, response_ids = prompt_ids.to(device), response_ids.to(device)
    unmask_step, response_mask = unmask_step.to(device), response_mask.to(device)
    P = prompt_ids.numel()
    G, R = response_ids.shape
    rb, rpos = response_blocks(P, R, block_size)
    rb, rpos = rb.to(device), rpos.to(device)
    zp = torch.zeros(P, dtype=torch.long, device=device)
    zr = torch.zeros(R, dtype=torch.long, device=device)
    out = torch.zeros(G, R, dtype=torch.float32, device=device)
    if not response_mask.any():
        return out

    cache = KVCache()
    forward_hidden(model, prompt_ids[None], torch.arange(P, device=device), block_mask(zp, zp, zp, zp), cache)
    cache.expand(G)
    k_block = torch.cat([zp, rb])
    forward_hidden(model, response_ids, rpos, block_mask(rb, zr, k_block, torch.zeros_like(k_block)), cache)

    ones = torch.ones(R, dtype=torch.long, device=device)
    noisy_mask = block_mask(rb, ones, torch.cat([k_block, rb]), torch.cat([torch.zeros_like(k_block), ones]))
    n_steps = int(unmask_step[response_mask].max()) + 1
    for s in range(n_steps):
        score = response_mask & (unmask_step == s)
        if not score.any():
            continue
        noisy = torch.where(unmask_step < s, response_ids, torch.full_like(response_ids, mask_id))
        h = forward_hidden(model, noisy, rpos, noisy_mask, cache, keep=0)
        logits = token_logits(model, h[score], mask_id)  # [n, V] fp32
        out[score] = torch.log_softmax(logits, dim=-1).gather(-1, response_ids[score][:, None]).squeeze(-1)
    return out
