"""Per-token log-probs of sampled responses under the block-diffusion policy: three RL estimators.

A masked-diffusion policy has no left-to-right factorisation, so an RL loss needs an estimator of
``log pi(token)``. Three are offered (``rl.logprob_estimator``; one entry point, :func:`response_logprobs`):

* ``tracerl`` (TraceRL, Wang et al. 2025, ``Gen-Verse/dLLM-RL``; DICE's estimator): each token is scored in
  the state the sampler drew it in. A rollout records, for each response token, the denoising step ``s``
  (within its block) at which the sampler unmasked it; the state is every block's partially masked copy
  with the tokens unmasked before step ``s`` visible (``unmask_step < s``) and the rest ``<|mask|>``,
  attending the clean earlier blocks and the prompt. Exact for the sampler's per-step distribution.
* ``coupled`` (DiffuCoder's coupled-GRPO, Gong et al. 2025, arXiv 2506.20639, ``apple/ml-diffucoder``):
  a mask ratio ``t ~ U(0.2, 0.8)`` and a mask ``m`` (each response token masked with probability ``t``) are
  drawn from a seed; two passes score the tokens of ``m`` with ``m`` masked and the tokens of ``~m`` with
  ``~m`` masked, so every token is scored exactly once, with the other part of its block visible.
  DiffuCoder's trainer adds a third, fully masked pass and weights by the mask rate; this module keeps the
  two complementary passes. Blocks: the masks apply within each block, which attends the prompt and the
  clean earlier blocks (the ``x_t ‖ x_0`` layout). A Monte-Carlo estimate: unbiased for the expectation over
  masks (tests/test_policy_estimators.py checks it against the enumeration of all masks).
* ``diffu_grpo`` (d1's diffu-GRPO, Zhao et al. 2025, arXiv 2504.12216, ``dllm-reasoning/d1``): one
  forward with the whole response masked (every block, so a token sees only the prompt; d1 may also mask
  each prompt token with probability ``p_mask_prompt``, 0 here unless asked); each token's log-prob at that
  single state. One pass, the cheapest and the coarsest.

All of them use BD3-LM's / SDAR's ``x_t ‖ x_0`` layout (see :mod:`dice_ray.policy.model`): the prompt and
clean response are encoded once (block-causal, keys/values kept with their autograd history); then one pass
per noisy state (TraceRL: per step index ``s``, at most ``block_size``; coupled: two) runs a noisy response
with the same position ids; noisy block ``b`` sees the prompt, clean blocks ``< b`` and itself. This equals
one ``[prompt, clean, noisy]`` forward with the x_t ‖ x_0 mask, without recomputing the prompt and clean
part for every state.
"""

from __future__ import annotations

from typing import Literal

import torch

from dice_ray.policy.families import family_of, require_block_diffusion
from dice_ray.policy.model import KVCache, block_mask, forward_hidden, response_blocks, token_logits

Estimator = Literal["tracerl", "coupled", "diffu_grpo"]
ESTIMATORS: tuple[str, ...] = ("tracerl", "coupled", "diffu_grpo")
COUPLED_MASK_RATIO = (0.2, 0.8)
"""DiffuCoder's range of the coupled mask ratio ``t`` (``random.uniform(0.2, 0.8)`` in its trainer)."""


def _check(prompt_ids: torch.Tensor, response_ids: torch.Tensor, **same_shape: torch.Tensor) -> None:
    """Raise ValueError unless prompt_ids is non-empty 1-D, response_ids is 2-D and ``same_shape`` match it."""
    if prompt_ids.dim() != 1 or prompt_ids.numel() == 0:
        raise ValueError(f"prompt_ids: must be a non-empty 1-D LongTensor, got shape {tuple(prompt_ids.shape)}")
    if response_ids.dim() != 2:
        raise ValueError(f"response_ids: must be [G, R], got shape {tuple(response_ids.shape)}")
    for name, t in same_shape.items():
        if t.shape != response_ids.shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)} must equal response_ids {tuple(response_ids.shape)}")


def _gather_logprobs(model, hidden: torch.Tensor, targets: torch.Tensor, mask_id: int) -> torch.Tensor:
    """FloatTensor[n] log p(targets) from hidden states [n, hidden] (fp32, mask token excluded)."""
    logits = token_logits(model, hidden, mask_id)
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)


def _score_noisy_states(
    model, prompt_ids: torch.Tensor, response_ids: torch.Tensor, states: list[tuple[torch.Tensor, torch.Tensor]],
    block_size: int, mask_id: int,
) -> torch.Tensor:
    """Score tokens in noisy states of the response, each block attending the prompt and clean earlier blocks.

    Args:
        prompt_ids: LongTensor[P]; response_ids: LongTensor[G, R] (same device as the model).
        states: ``(noisy_ids, score)`` pairs, LongTensor[G, R] (``<|mask|>`` where masked) and BoolTensor[G, R]
            (the tokens scored in that state; each token in at most one state).

    Returns:
        FloatTensor[G, R] (fp32), log p(token | its state); 0 where no state scores it. Differentiable.
    """
    device = response_ids.device
    P = prompt_ids.numel()
    G, R = response_ids.shape
    out = torch.zeros(G, R, dtype=torch.float32, device=device)
    states = [(ids, score) for ids, score in states if score.any()]
    if not states:
        return out
    rb, rpos = response_blocks(P, R, block_size)
    rb, rpos = rb.to(device), rpos.to(device)
    zp = torch.zeros(P, dtype=torch.long, device=device)
    zr = torch.zeros(R, dtype=torch.long, device=device)

    cache = KVCache()
    forward_hidden(model, prompt_ids[None], torch.arange(P, device=device), block_mask(zp, zp, zp, zp), cache)
    cache.expand(G)
    k_block = torch.cat([zp, rb])
    forward_hidden(model, response_ids, rpos, block_mask(rb, zr, k_block, torch.zeros_like(k_block)), cache)

    ones = torch.ones(R, dtype=torch.long, device=device)
    noisy_mask = block_mask(rb, ones, torch.cat([k_block, rb]), torch.cat([torch.zeros_like(k_block), ones]))
    for noisy, score in states:
        h = forward_hidden(model, noisy, rpos, noisy_mask, cache, keep=0)
        out[score] = _gather_logprobs(model, h[score], response_ids[score], mask_id)
    return out


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
    _check(prompt_ids, response_ids, unmask_step=unmask_step, response_mask=response_mask)
    response_mask = response_mask.bool()
    if response_mask.any():
        scored = unmask_step[response_mask]
        if scored.min() < 0 or scored.max() >= block_size:
            raise ValueError(f"unmask_step: scored values must lie in [0, {block_size}), got "
                             f"[{int(scored.min())}, {int(scored.max())}]")
    response_blocks(prompt_ids.numel(), response_ids.shape[1], block_size)  # raises on a partial block
    device = next(model.parameters()).device
    prompt_ids, response_ids = prompt_ids.to(device), response_ids.to(device)
    unmask_step, response_mask = unmask_step.to(device), response_mask.to(device)
    n_steps = int(unmask_step[response_mask].max()) + 1 if response_mask.any() else 0
    states = [
        (torch.where(unmask_step < s, response_ids, torch.full_like(response_ids, mask_id)),
         response_mask & (unmask_step == s))
        for s in range(n_steps)
    ]
    return _score_noisy_states(model, prompt_ids, response_ids, states, block_size, mask_id)


def coupled_mask(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """DiffuCoder's coupled mask draw: ``t ~ U(0.2, 0.8)``, then each position masked with probability ``t``.

    Drawn on the CPU from ``torch.Generator().manual_seed(seed)``, so the same seed gives the same mask on
    every device: the learner's old-policy and new-policy passes share it.

    Args:
        shape: ``(G, R)``.
        seed: any int accepted by ``torch.Generator.manual_seed``.

    Returns:
        BoolTensor[G, R] (CPU), True = masked in the first pass (the second pass masks the complement).
    """
    gen = torch.Generator().manual_seed(seed)
    lo, hi = COUPLED_MASK_RATIO
    t = lo + (hi - lo) * torch.rand((), generator=gen, dtype=torch.float64)
    return torch.rand(shape, generator=gen, dtype=torch.float64) < t


def coupled_logprobs(
    model,
    prompt_ids: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    block_size: int,
    mask_id: int,
    mask: torch.Tensor,
) -> torch.Tensor:
    """Coupled-GRPO log-probs (DiffuCoder, Gong et al. 2025) for one given mask and its complement.

    Pass 1 masks ``mask`` and scores those tokens; pass 2 masks ``~mask`` and scores the rest. Every block
    attends the prompt and the clean earlier blocks.

    Args:
        model, prompt_ids, response_ids, response_mask, block_size, mask_id: as in :func:`tracerl_logprobs`.
        mask: BoolTensor[G, R], e.g. from :func:`coupled_mask`.

    Returns:
        FloatTensor[G, R] (fp32) log p(token | the tokens of the other pass visible); 0 where
        ``response_mask`` is False. Differentiable.

    Raises:
        ValueError: shapes disagree or R is not a multiple of ``block_size``.
    """
    _check(prompt_ids, response_ids, response_mask=response_mask, mask=mask)
    response_blocks(prompt_ids.numel(), response_ids.shape[1], block_size)
    device = next(model.parameters()).device
    prompt_ids, response_ids = prompt_ids.to(device), response_ids.to(device)
    response_mask, mask = response_mask.to(device).bool(), mask.to(device).bool()
    masked = torch.full_like(response_ids, mask_id)
    states = [(torch.where(m, masked, response_ids), response_mask & m) for m in (mask, ~mask)]
    return _score_noisy_states(model, prompt_ids, response_ids, states, block_size, mask_id)


def diffu_grpo_logprobs(
    model,
    prompt_ids: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    block_size: int,
    mask_id: int,
    p_mask_prompt: float = 0.0,
    seed: int = 0,
) -> torch.Tensor:
    """d1's one-step log-probs (diffu-GRPO, Zhao et al. 2025): the whole response masked, one forward.

    The masked response runs block-causally after the prompt (block ``b`` attends the prompt and the masked
    blocks ``<= b``), so each token's log-prob is ``log p(x_i | prompt, response fully masked)``.

    Args:
        model, prompt_ids, response_ids, response_mask, block_size, mask_id: as in :func:`tracerl_logprobs`.
        p_mask_prompt: d1's prompt masking: each prompt token is replaced by ``<|mask|>`` with this
            probability (one draw shared by the group), from ``seed``; 0 (default) keeps the prompt.
        seed: seeds the prompt mask (CPU generator); unused when ``p_mask_prompt`` is 0.

    Returns:
        FloatTensor[G, R] (fp32); 0 where ``response_mask`` is False. Differentiable.

    Raises:
        ValueError: shapes disagree, R is not a multiple of ``block_size``, or ``p_mask_prompt`` is outside
            ``[0, 1]``.
    """
    _check(prompt_ids, response_ids, response_mask=response_mask)
    if not 0.0 <= p_mask_prompt <= 1.0:
        raise ValueError(f"p_mask_prompt: must lie in [0, 1], got {p_mask_prompt}")
    P = prompt_ids.numel()
    G, R = response_ids.shape
    rb, rpos = response_blocks(P, R, block_size)
    device = next(model.parameters()).device
    if p_mask_prompt > 0:
        gen = torch.Generator().manual_seed(seed)
        hide = torch.rand(P, generator=gen, dtype=torch.float64) < p_mask_prompt
        prompt_ids = torch.where(hide, torch.full_like(prompt_ids, mask_id), prompt_ids.cpu())
    prompt_ids, response_ids = prompt_ids.to(device), response_ids.to(device)
    response_mask = response_mask.to(device).bool()
    out = torch.zeros(G, R, dtype=torch.float32, device=device)
    if not response_mask.any():
        return out
    rb, rpos = rb.to(device), rpos.to(device)
    zp = torch.zeros(P, dtype=torch.long, device=device)
    blocks, clean = torch.cat([zp, rb]), torch.zeros(P + R, dtype=torch.long, device=device)
    seq = torch.cat([prompt_ids[None].expand(G, -1), torch.full_like(response_ids, mask_id)], dim=1)
    h = forward_hidden(model, seq, torch.arange(P + R, device=device), block_mask(blocks, clean, blocks, clean))
    h = h[:, P:][response_mask]
    out[response_mask] = _gather_logprobs(model, h, response_ids[response_mask], mask_id)
    return out


def response_logprobs(
    estimator: Estimator,
    model,
    prompt_ids: torch.Tensor,
    response_ids: torch.Tensor,
    unmask_step: torch.Tensor,
    response_mask: torch.Tensor,
    block_size: int,
    mask_id: int,
    seed: int = 0,
) -> torch.Tensor:
    """Per-token log-probs of a group's responses with the chosen estimator (``rl.logprob_estimator``).

    Args:
        estimator: ``"tracerl"`` (:func:`tracerl_logprobs`), ``"coupled"`` (:func:`coupled_logprobs` with
            :func:`coupled_mask` of ``seed``) or ``"diffu_grpo"`` (:func:`diffu_grpo_logprobs`, prompt kept).
        model: the policy's Qwen3ForCausalLM (``dice_block`` attention); grads flow.
        prompt_ids: LongTensor[P]; response_ids: LongTensor[G, R], R a multiple of ``block_size``.
        unmask_step: LongTensor[G, R], the trace (see :func:`tracerl_logprobs`); only ``tracerl`` reads it.
        response_mask: BoolTensor[G, R], True for the tokens to score.
        block_size: tokens a block. mask_id: id of ``<|mask|>``.
        seed: the coupled mask's seed: pass the same seed for the old-policy and new-policy log-probs of a
            group. ``tracerl`` and ``diffu_grpo`` ignore it.

    Returns:
        FloatTensor[G, R] (fp32) log-probs; 0 where ``response_mask`` is False. Differentiable.

    Raises:
        ValueError: an unknown ``estimator``, or bad input (see the estimator's function).
        NotImplementedError: ``model`` is a LLaDA / Dream model (these estimators are SDAR-only).
    """
    require_block_diffusion(family_of(model), "RL log-probs (rl.logprob_estimator)")
    if estimator == "tracerl":
        return tracerl_logprobs(model, prompt_ids, response_ids, unmask_step, response_mask, block_size, mask_id)
    if estimator == "coupled":
        mask = coupled_mask(tuple(response_ids.shape), seed)
        return coupled_logprobs(model, prompt_ids, response_ids, response_mask, block_size, mask_id, mask)
    if estimator == "diffu_grpo":
        return diffu_grpo_logprobs(model, prompt_ids, response_ids, response_mask, block_size, mask_id)
    raise ValueError(f"estimator: must be one of {ESTIMATORS}, got {estimator!r}")
