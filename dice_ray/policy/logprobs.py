"""Per-token log-probs of sampled responses under the diffusion policy (SDAR, LLaDA, Dream): three RL estimators.

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
clean response are encoded once (block-causal, keys/values kept with their autograd history); then the noisy
states (TraceRL: one per step index ``s``, at most ``block_size``; coupled: two) run with the clean position ids;
noisy block ``b`` sees the prompt, clean blocks ``< b`` and itself. This equals one ``[prompt, clean, noisy]``
forward with the x_t ‖ x_0 mask for every state, without recomputing the prompt and clean part for each. Under
SDPA one pass a state; under FlexAttention (``cluster.learner_attention``), which skips masked tiles, one pass
for all of them, side by side on the sequence axis (state ``i`` as noisy copy ``i + 1`` of
:func:`~dice_ray.policy.model.block_mask`, seeing only its own copy of its block): a quarter of the layer calls
at four states, and GEMMs four times as tall (dense SDPA would compute the masked pairs between the copies).

The fully bidirectional families (LLaDA, Dream; :mod:`dice_ray.policy.families`) have no blocks: every state
is one forward of ``prompt ‖ response canvas ‖ suffix`` with full attention, through the sampler's own
:func:`dice_ray.policy.sampler.span_hidden` (rows right-padded, padding never attended), so the learner sees the
context the sampler saw: the suffix is the fixed text after an infilled span (``suffix_ids``, empty for
whole-response decoding; SDAR keeps the scaffold in its prompt and takes none), and ``tracerl`` can be given the
canvas length of every row at every step (``span_lens``: an infill span grows while it is decoded,
:attr:`~dice_ray.policy.samples.Rollout.span_lengths`). Dream's token at response position ``i`` is read from the
logits at ``i - 1`` (:func:`~dice_ray.policy.families.logit_shift`). The canvas is the response padded with
``<|mask|>`` to ``canvas_len`` tokens (the sampler's ``max_new_tokens``; default: the padded length R), or, for
``tracerl`` with ``span_lens``, cut or padded to the row's length at each step; positions where
``response_mask`` is False are ``<|mask|>`` in every state, as the sampler leaves the positions after a
response's first ``<|eos|>``, except, for ``tracerl``, those the sampler decoded before that ``eos`` (their
``unmask_step >= 0``: a rollout's tail). ``tracerl`` replays the trace over the whole response (``unmask_step``
counts the sampler's steps over the whole response: the state at step ``s`` shows the tokens with
``unmask_step < s``);
``coupled`` masks its two complementary parts of the whole response (DiffuCoder's own setting, on Dream);
``diffu_grpo`` masks the whole canvas (d1's own setting, on LLaDA). R need not be a multiple of ``block_size``
there (responses end at their ``<|eos|>``); ``block_size`` is unused.

Rows of a group are scored independently (each attends the shared prompt, its own response and the suffix), so a
group can be scored in row chunks (``response_logprobs(..., rows=slice)``, the learner's
``cluster.learner_rows_per_chunk``): each chunk runs every pass, the prompt's included, with its own rows, and its
autograd graph (the training :class:`~dice_ray.policy.model.KVCache` it builds included) is its own; the prompt is
encoded once a chunk, and its gradient is the sum over the chunks.

How many states a call scores, and for LLaDA / Dream how many model calls it makes, depends on the data: one state
per ``tracerl`` distinct denoising step of the scored tokens (however many the trace has), ``coupled``'s masks that
hold a scored token, ``diffu_grpo``'s one (none when nothing is scored); SDAR runs them after its prompt and clean
passes (one stacked pass under FlexAttention), LLaDA / Dream one pass a state. Under ZeRO-3
every forward of a module gathers its parameters across the learner's ranks, so every rank must make the same calls:
``passes=n`` (:func:`state_passes` gives the fewest a call accepts) makes a call run exactly ``n`` state passes,
the states that score nothing padded in after the real ones (an all-masked state, one row of it for LLaDA /
Dream), the prompt and clean passes always, and keeps every pass in the autograd graph of the output, so that a
backward visits each of them too; the log-probs are unchanged (a padding pass scores no token).
"""

from __future__ import annotations

from typing import Literal

import torch

from dice_ray.policy.compiled import is_compiled, token_logprobs
from dice_ray.policy.families import family_of, logit_shift
from dice_ray.policy.model import (KVCache, attention_of, block_mask, forward_hidden, prompt_blocks, response_blocks,
                                   token_logits)
from dice_ray.policy.sampler import span_hidden

Estimator = Literal["tracerl", "coupled", "diffu_grpo"]
ESTIMATORS: tuple[str, ...] = ("tracerl", "coupled", "diffu_grpo")
COUPLED_MASK_RATIO = (0.2, 0.8)
"""DiffuCoder's range of the coupled mask ratio ``t`` (``random.uniform(0.2, 0.8)`` in its trainer)."""
BIDIRECTIONAL: tuple[str, ...] = ("llada", "dream")
"""Families scored with full attention over prompt ‖ whole response (no block-causal mask)."""


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
    """FloatTensor[n] log p(targets) from hidden states [n, hidden] (fp32, mask token excluded); one compiled region
    when the model's layers are compiled (:func:`dice_ray.policy.compiled.token_logprobs`)."""
    if is_compiled(model):
        return token_logprobs(model, hidden, targets, mask_id)
    logits = token_logits(model, hidden, mask_id)
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)


def _bidirectional_shift(model) -> int | None:
    """``logit_shift`` of a LLaDA / Dream model (0 / 1); None for SDAR or an unknown model (block layout)."""
    family = family_of(model)
    return logit_shift(family) if family in BIDIRECTIONAL else None


def _canvas_len(canvas_len: int | None, R: int) -> int:
    """The canvas length C (``canvas_len``, default R); raises ValueError if it is shorter than R."""
    if canvas_len is None:
        return R
    if canvas_len < R:
        raise ValueError(f"canvas_len: must be >= the response length {R} (the sampler's max_new_tokens), "
                         f"got {canvas_len}")
    return int(canvas_len)


def _suffix(suffix_ids: torch.Tensor | None, shift: int | None, device: torch.device) -> torch.Tensor:
    """The suffix as LongTensor[S] on ``device`` (None: empty); ValueError unless 1-D, or if non-empty for SDAR."""
    if suffix_ids is None:
        return torch.zeros(0, dtype=torch.long, device=device)
    if suffix_ids.dim() != 1:
        raise ValueError(f"suffix_ids: must be a 1-D LongTensor, got shape {tuple(suffix_ids.shape)}")
    if shift is None and suffix_ids.numel():
        raise ValueError("suffix_ids: must be empty for SDAR, which keeps the scaffold in its prompt (block diffusion "
                         "decodes left to right, as DICE does); a suffix after the span is for LLaDA / Dream")
    return suffix_ids.to(device)


def state_passes(estimator: Estimator, unmask_step: torch.Tensor, response_mask: torch.Tensor) -> int:
    """The fewest state passes ``response_logprobs(estimator, ..., passes=n)`` accepts for these rows: ``tracerl``
    one a distinct ``unmask_step`` of the scored tokens, at least 1; ``coupled`` 2; ``diffu_grpo`` 1. A call given
    that many makes the same model calls whatever the family; the learner gives every rank's call in a slot the
    most any rank's rows there need (ZeRO-3: equal collectives, :func:`dice_ray.cluster.learner.plan_step`).

    Args:
        estimator: one of :data:`ESTIMATORS`.
        unmask_step: LongTensor[G, R] (the rows scored, after any ``rows`` cut).
        response_mask: BoolTensor[G, R], True on the tokens scored.

    Raises:
        ValueError: an unknown estimator, or the two tensors differ in shape.
    """
    if unmask_step.shape != response_mask.shape:
        raise ValueError(f"unmask_step {tuple(unmask_step.shape)} and response_mask {tuple(response_mask.shape)} "
                         "must have one shape")
    if estimator == "tracerl":
        return max(1, int(torch.unique(unmask_step[response_mask.bool()]).numel()))
    if estimator == "coupled":
        return 2
    if estimator == "diffu_grpo":
        return 1
    raise ValueError(f"estimator: must be one of {ESTIMATORS}, got {estimator!r}")


def _pad_states(states: list[tuple], passes: int | None, pad: tuple) -> list[tuple]:
    """The states a call scores in: those scoring a token (``state[1]``, BoolTensor[G, R], has a True), then, given
    ``passes``, ``pad`` (a state scoring nothing) until there are ``passes``.

    Raises:
        ValueError: ``passes`` is fewer than the states that score a token.
    """
    states = [s for s in states if s[1].any()]
    if passes is None:
        return states
    if passes < len(states):
        raise ValueError(f"passes: these rows score tokens in {len(states)} states, more than passes={passes}")
    return states + [pad] * (passes - len(states))


def _score_full_states(
    model, prompt_ids: torch.Tensor, suffix_ids: torch.Tensor, response_ids: torch.Tensor,
    states: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], mask_id: int, shift: int,
    passes: int | None = None,
) -> torch.Tensor:
    """Score tokens in states of the span under full attention (LLaDA / Dream), in the sampler's layout.

    Each state is one forward (:func:`dice_ray.policy.sampler.span_hidden`, the sampler's) over the rows that score
    a token in it, row ``g`` being ``prompt ‖ canvas ‖ suffix``: its noisy response cut, or padded with
    ``<|mask|>``, to its canvas length in that state; rows right-padded, padding never attended; response
    position ``i`` is read from sequence position ``P + i - shift``.

    Args:
        prompt_ids: LongTensor[P], P >= 1; suffix_ids: LongTensor[S], S >= 0; response_ids: LongTensor[G, R]
            (same device as the model).
        states: ``(noisy_ids, score, canvas)``: LongTensor[G, R] and BoolTensor[G, R] as in
            :func:`_score_noisy_states`, and LongTensor[G], each row's canvas length in that state (tokens).
        shift: :func:`~dice_ray.policy.families.logit_shift` of the family (Dream 1, LLaDA 0).
        passes: None: one forward a state that scores a token; n: exactly n, padded with forwards of row 0's
            all-masked canvas of R tokens that score nothing (:func:`_pad_states`).

    Returns:
        FloatTensor[G, R] (fp32), log p(token | its state); 0 where no state scores it. Differentiable (given
        ``passes``, through every pass).

    Raises:
        ValueError: a scoring row's canvas does not reach a position the state shows or scores; ``passes`` is fewer
            than the states that score a token.
    """
    device = response_ids.device
    P = prompt_ids.numel()
    G, R = response_ids.shape
    out = torch.zeros(G, R, dtype=torch.float32, device=device)
    ends = torch.arange(1, R + 1, device=device)  # position + 1
    pad = (torch.full_like(response_ids, mask_id), torch.zeros_like(response_ids, dtype=torch.bool),
           torch.full((G,), R, device=device))
    for noisy, score, canvas in _pad_states(states, passes, pad):
        rows = score.any(dim=1).nonzero().squeeze(1)
        if rows.numel() == 0:  # a padding pass: row 0 alone, scoring nothing
            rows = torch.zeros(1, dtype=torch.long, device=device)
        lens = canvas[rows].tolist()
        reach = torch.where((noisy[rows] != mask_id) | score[rows], ends, 0).amax(1).tolist()
        short = [(n, r) for n, r in zip(lens, reach) if r > n]
        if short:
            raise ValueError(f"span_lens: a state's span must hold every token it shows or scores; a span of "
                             f"{short[0][0]} tokens must reach position {short[0][1] - 1}")
        width = max(R, max(lens))
        padded = torch.cat([noisy[rows], torch.full((rows.numel(), width - R), mask_id, device=device)], dim=1)
        seqs = [torch.cat([prompt_ids, padded[k, :n], suffix_ids]) for k, n in enumerate(lens)]
        h = span_hidden(model, seqs, [P] * len(seqs), [R] * len(seqs), shift, mask_id)  # [rows, R, hidden]
        r_idx, i_idx = score[rows].nonzero(as_tuple=True)
        out[rows[r_idx], i_idx] = _gather_logprobs(model, h[r_idx, i_idx], response_ids[rows[r_idx], i_idx], mask_id)
    return out


def _score_noisy_states(
    model, prompt_ids: torch.Tensor, response_ids: torch.Tensor, states: list[tuple[torch.Tensor, torch.Tensor]],
    block_size: int, mask_id: int, passes: int | None = None,
) -> torch.Tensor:
    """Score tokens in noisy states of the response, each block attending the prompt and clean earlier blocks.

    Args:
        prompt_ids: LongTensor[P]; response_ids: LongTensor[G, R] (same device as the model).
        states: ``(noisy_ids, score)`` pairs, LongTensor[G, R] (``<|mask|>`` where masked) and BoolTensor[G, R]
            (the tokens scored in that state; each token in at most one state).
        passes: None: one pass a state that scores a token, and none at all (not even the prompt's) when none
            does; n: the prompt and clean passes and exactly n state passes, padded with all-masked ones that score
            nothing (:func:`_pad_states`).

    Returns:
        FloatTensor[G, R] (fp32), log p(token | its state); 0 where no state scores it. Differentiable (given
        ``passes``, through every pass).

    Raises:
        ValueError: ``passes`` is fewer than the states that score a token.
    """
    device = response_ids.device
    P = prompt_ids.numel()
    G, R = response_ids.shape
    out = torch.zeros(G, R, dtype=torch.float32, device=device)
    states = _pad_states(states, passes, (torch.full_like(response_ids, mask_id),
                                          torch.zeros_like(response_ids, dtype=torch.bool)))
    if not states:
        return out
    rb, rpos = response_blocks(P, R, block_size)
    rb, rpos = rb.to(device), rpos.to(device)
    zp = torch.zeros(P, dtype=torch.long, device=device)
    zr = torch.zeros(R, dtype=torch.long, device=device)
    pb = prompt_blocks(P, block_size, device)

    cache = KVCache()
    forward_hidden(model, prompt_ids[None], torch.arange(P, device=device), block_mask(pb, zp, pb, zp), cache)
    cache.expand(G)
    k_block = torch.cat([pb, rb])
    forward_hidden(model, response_ids, rpos, block_mask(rb, zr, k_block, torch.zeros_like(k_block)), cache)

    if attention_of(model) != "flex":  # dense SDPA would compute every masked pair of a stacked pass: one a state
        ones = torch.ones(R, dtype=torch.long, device=device)
        noisy_mask = block_mask(rb, ones, torch.cat([k_block, rb]), torch.cat([torch.zeros_like(k_block), ones]))
        for noisy, score in states:
            h = forward_hidden(model, noisy, rpos, noisy_mask, cache, keep=0)
            out[score] = _gather_logprobs(model, h[score], response_ids[score], mask_id)
        return out
    # FlexAttention skips masked tiles: every state in one forward, side by side on the sequence axis, state i as
    # noisy copy i + 1 (block_mask: a noisy block sees the prompt, the clean earlier blocks and its own copy only)
    S = len(states)
    copy = torch.arange(1, S + 1, device=device).repeat_interleave(R)
    q_block = rb.repeat(S)
    noisy_mask = block_mask(q_block, copy, torch.cat([k_block, q_block]), torch.cat([torch.zeros_like(k_block), copy]))
    noisy = torch.cat([n for n, _ in states], dim=1)  # [G, S*R]
    score = torch.cat([sc for _, sc in states], dim=1)
    h = forward_hidden(model, noisy, rpos.repeat(S), noisy_mask, cache, keep=0)
    stacked = torch.zeros(G, S * R, dtype=torch.float32, device=device)
    stacked[score] = _gather_logprobs(model, h[score], response_ids.repeat(1, S)[score], mask_id)
    return out + stacked.view(G, S, R).sum(1)  # a token is scored in at most one state


def tracerl_logprobs(
    model,
    prompt_ids: torch.Tensor,
    response_ids: torch.Tensor,
    unmask_step: torch.Tensor,
    response_mask: torch.Tensor,
    block_size: int,
    mask_id: int,
    canvas_len: int | None = None,
    suffix_ids: torch.Tensor | None = None,
    span_lens: torch.Tensor | None = None,
    passes: int | None = None,
) -> torch.Tensor:
    """Per-token log-probs of a group's responses in the denoising states that produced them (TraceRL, Wang et al.
    2025).

    SDAR: block by block (``x_t ‖ x_0``). LLaDA / Dream: the state at step ``s`` is ``prompt ‖ canvas ‖ suffix``,
    the canvas showing the tokens of ``unmask_step < s`` and ``<|mask|>`` elsewhere, under full attention (Dream:
    shifted logits), as long as the sampler's was at that step; see the module docstring.

    Args:
        model: the policy's transformers model (``dice_block`` attention; SDAR Qwen3, LLaDA Llama or Dream
            Qwen2, told apart by :func:`~dice_ray.policy.families.family_of`); train or eval mode, grads flow.
        prompt_ids: LongTensor[P], the shared prompt of the group.
        response_ids: LongTensor[G, R]; SDAR: R a multiple of ``block_size`` (rows padded with whole blocks).
        unmask_step: LongTensor[G, R], 0-based denoising step at which each token was unmasked. SDAR: the step
            within its block; tokens not scored but inside a scored block (e.g. after ``<|eos|>``) must still
            carry their real step: they are part of the state other tokens were drawn in; padding blocks: any
            value. LLaDA / Dream: the step over the whole response (the sampler's count); an unscored position
            with a step >= 0 is context the sampler decoded (a tail after ``eos``, :attr:`Rollout.tail_ids`):
            visible in the states after its step; with -1 (padding, never decoded) it is ``<|mask|>`` in every
            state.
        response_mask: BoolTensor[G, R], True for the tokens to score (padding False).
        block_size: tokens a block (SDAR only).
        mask_id: id of ``<|mask|>``.
        canvas_len: LLaDA / Dream: the length the sampler decoded (its ``max_new_tokens``), >= R; None: R.
            Ignored for SDAR, and when ``span_lens`` is given.
        suffix_ids: LongTensor[S], LLaDA / Dream: the fixed tokens after the span (an infill's suffix,
            :attr:`Rollout.suffix_ids`), attended in every state; None or empty: none (whole-response decoding).
        span_lens: LLaDA / Dream: LongTensor[G, N], ``span_lens[g, s]`` the length (tokens) of row ``g``'s canvas
            at step ``s`` (:attr:`Rollout.span_lengths`; a grown infill span gets longer while it is decoded);
            N beyond every scored step; entries past a row's last step are unused (0). None: ``canvas_len`` at
            every step.
        passes: None: one pass a scored step; n (>= :func:`state_passes`): exactly n, the same model calls
            whatever the trace (see the module docstring).

    Returns:
        FloatTensor[G, R] (fp32) log p(token | state at its step); 0 where ``response_mask`` is False.
        Differentiable w.r.t. the model parameters.

    Raises:
        ValueError: shapes disagree; SDAR: R is not a multiple of ``block_size``, a scored ``unmask_step`` is
            outside ``[0, block_size)``, or a suffix or ``span_lens`` is given (SDAR keeps the scaffold in its
            prompt); LLaDA / Dream: a scored ``unmask_step`` is negative, ``canvas_len < R``, ``span_lens`` is not
            ``[G, N]`` with N beyond the last scored step, or a step's span does not reach a token it shows or
            scores; ``passes`` is fewer than the scored steps.
    """
    _check(prompt_ids, response_ids, unmask_step=unmask_step, response_mask=response_mask)
    response_mask = response_mask.bool()
    shift = _bidirectional_shift(model)
    if response_mask.any():
        scored = unmask_step[response_mask]
        top = block_size if shift is None else None
        if scored.min() < 0 or (top is not None and scored.max() >= top):
            rule = f"[0, {block_size})" if top is not None else ">= 0 (LLaDA / Dream: steps over the whole response)"
            raise ValueError(f"unmask_step: scored values must lie in {rule}, got "
                             f"[{int(scored.min())}, {int(scored.max())}]")
    if shift is None:
        response_blocks(prompt_ids.numel(), response_ids.shape[1], block_size)  # raises on a partial block
        if span_lens is not None:
            raise ValueError("span_lens: SDAR decodes fixed blocks; a span trace is for LLaDA / Dream")
    device = next(model.parameters()).device
    suffix_ids = _suffix(suffix_ids, shift, device)
    prompt_ids, response_ids = prompt_ids.to(device), response_ids.to(device)
    unmask_step, response_mask = unmask_step.to(device), response_mask.to(device)
    masked = torch.full_like(response_ids, mask_id)
    if shift is None:
        n_steps = int(unmask_step[response_mask].max()) + 1 if response_mask.any() else 0
        states = [(torch.where(unmask_step < s, response_ids, masked), response_mask & (unmask_step == s))
                  for s in range(n_steps)]
        return _score_noisy_states(model, prompt_ids, response_ids, states, block_size, mask_id, passes)
    G, R = response_ids.shape
    steps = torch.unique(unmask_step[response_mask]).tolist()
    if span_lens is None:
        canvas = [torch.full((G,), _canvas_len(canvas_len, R), device=device)] * len(steps)
    else:
        if span_lens.dim() != 2 or span_lens.shape[0] != G or (steps and span_lens.shape[1] <= steps[-1]):
            raise ValueError(f"span_lens: must be [G={G}, N] with N > the last scored unmask_step "
                             f"({steps[-1] if steps else None}), got shape {tuple(span_lens.shape)}")
        canvas = [span_lens[:, s].to(device) for s in steps]
    shown = response_mask | (unmask_step >= 0)  # scored tokens, and decoded context after the eos (tail)
    states = [(torch.where(shown & (unmask_step < s), response_ids, masked), response_mask & (unmask_step == s), c)
              for s, c in zip(steps, canvas)]
    return _score_full_states(model, prompt_ids, suffix_ids, response_ids, states, mask_id, shift, passes)


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
    canvas_len: int | None = None,
    suffix_ids: torch.Tensor | None = None,
    passes: int | None = None,
) -> torch.Tensor:
    """Coupled-GRPO log-probs (DiffuCoder, Gong et al. 2025, arXiv 2506.20639) for one given mask and its
    complement.

    Pass 1 masks ``mask`` and scores those tokens; pass 2 masks ``~mask`` and scores the rest. SDAR: every
    block attends the prompt and the clean earlier blocks. LLaDA / Dream: each pass is one full-attention
    forward of ``prompt ‖ canvas ‖ suffix`` (unscored positions ``<|mask|>`` in both passes; Dream: shifted
    logits).

    Args:
        model, prompt_ids, response_ids, response_mask, block_size, mask_id, canvas_len, suffix_ids: as in
            :func:`tracerl_logprobs`.
        mask: BoolTensor[G, R], e.g. from :func:`coupled_mask`.
        passes: None: a pass is skipped when it scores no token; 2: both run, whatever the mask.

    Returns:
        FloatTensor[G, R] (fp32) log p(token | the tokens of the other pass visible); 0 where
        ``response_mask`` is False. Differentiable.

    Raises:
        ValueError: shapes disagree; SDAR: R is not a multiple of ``block_size``, or a suffix is given; LLaDA /
            Dream: ``canvas_len < R``; ``passes`` other than None or 2.
    """
    _check(prompt_ids, response_ids, response_mask=response_mask, mask=mask)
    if passes not in (None, 2):
        raise ValueError(f"passes: the coupled estimator runs 2 passes, got passes={passes}")
    shift = _bidirectional_shift(model)
    if shift is None:
        response_blocks(prompt_ids.numel(), response_ids.shape[1], block_size)
    device = next(model.parameters()).device
    suffix_ids = _suffix(suffix_ids, shift, device)
    prompt_ids, response_ids = prompt_ids.to(device), response_ids.to(device)
    response_mask, mask = response_mask.to(device).bool(), mask.to(device).bool()
    masked = torch.full_like(response_ids, mask_id)
    if shift is None:
        states = [(torch.where(m, masked, response_ids), response_mask & m) for m in (mask, ~mask)]
        return _score_noisy_states(model, prompt_ids, response_ids, states, block_size, mask_id, passes)
    canvas = torch.full((response_ids.shape[0],), _canvas_len(canvas_len, response_ids.shape[1]), device=device)
    states = [(torch.where(response_mask & ~m, response_ids, masked), response_mask & m, canvas) for m in (mask, ~mask)]
    return _score_full_states(model, prompt_ids, suffix_ids, response_ids, states, mask_id, shift, passes)


def diffu_grpo_logprobs(
    model,
    prompt_ids: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    block_size: int,
    mask_id: int,
    p_mask_prompt: float = 0.0,
    seed: int = 0,
    canvas_len: int | None = None,
    suffix_ids: torch.Tensor | None = None,
    passes: int | None = None,
) -> torch.Tensor:
    """d1's one-step log-probs (diffu-GRPO, Zhao et al. 2025, arXiv 2504.12216): the whole response masked, one
    forward.

    SDAR: the masked response runs block-causally after the prompt (block ``b`` attends the prompt and the
    masked blocks ``<= b``). LLaDA / Dream: ``prompt ‖ <|mask|> * canvas_len ‖ suffix`` under full attention, one
    batch-1 forward shared by the group (Dream: shifted logits). Each token's log-prob is
    ``log p(x_i | prompt, response fully masked, suffix)``.

    Args:
        model, prompt_ids, response_ids, response_mask, block_size, mask_id, canvas_len, suffix_ids: as in
            :func:`tracerl_logprobs`.
        p_mask_prompt: d1's prompt masking: each prompt token is replaced by ``<|mask|>`` with this
            probability (one draw shared by the group), from ``seed``; 0 (default) keeps the prompt (the suffix
            always stays clean).
        seed: seeds the prompt mask (CPU generator); unused when ``p_mask_prompt`` is 0.
        passes: None: no forward when nothing is scored; 1: the forward whatever the mask.

    Returns:
        FloatTensor[G, R] (fp32); 0 where ``response_mask`` is False. Differentiable (given ``passes``, always).

    Raises:
        ValueError: shapes disagree, ``p_mask_prompt`` is outside ``[0, 1]``; SDAR: R is not a multiple of
            ``block_size``, or a suffix is given; LLaDA / Dream: ``canvas_len < R``; ``passes`` other than None or 1.
    """
    _check(prompt_ids, response_ids, response_mask=response_mask)
    if passes not in (None, 1):
        raise ValueError(f"passes: the diffu_grpo estimator runs 1 pass, got passes={passes}")
    if not 0.0 <= p_mask_prompt <= 1.0:
        raise ValueError(f"p_mask_prompt: must lie in [0, 1], got {p_mask_prompt}")
    P = prompt_ids.numel()
    G, R = response_ids.shape
    shift = _bidirectional_shift(model)
    if shift is None:
        rb, rpos = response_blocks(P, R, block_size)
    else:
        C = _canvas_len(canvas_len, R)
    device = next(model.parameters()).device
    suffix_ids = _suffix(suffix_ids, shift, device)
    if p_mask_prompt > 0:
        gen = torch.Generator().manual_seed(seed)
        hide = torch.rand(P, generator=gen, dtype=torch.float64) < p_mask_prompt
        prompt_ids = torch.where(hide, torch.full_like(prompt_ids, mask_id), prompt_ids.cpu())
    prompt_ids, response_ids = prompt_ids.to(device), response_ids.to(device)
    response_mask = response_mask.to(device).bool()
    out = torch.zeros(G, R, dtype=torch.float32, device=device)
    if passes is None and not response_mask.any():
        return out
    if shift is not None:
        seq = torch.cat([prompt_ids, torch.full((C,), mask_id, dtype=torch.long, device=device), suffix_ids])
        h = span_hidden(model, [seq], [P], [R], shift, mask_id)[0]  # [R, hidden], the same state for every row
        _, i_idx = response_mask.nonzero(as_tuple=True)
        out[response_mask] = _gather_logprobs(model, h[i_idx], response_ids[response_mask], mask_id)
        return out
    rb, rpos = rb.to(device), rpos.to(device)
    blocks, clean = torch.cat([prompt_blocks(P, block_size, device), rb]), torch.zeros(P + R, dtype=torch.long, device=device)
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
    canvas_len: int | None = None,
    suffix_ids: torch.Tensor | None = None,
    span_lens: torch.Tensor | None = None,
    rows: slice | None = None,
    passes: int | None = None,
) -> torch.Tensor:
    """Per-token log-probs of a group's responses with the chosen estimator (``rl.logprob_estimator``).

    Every family: SDAR block by block, LLaDA / Dream with full attention over prompt ‖ span ‖ suffix (Dream's
    logits shifted by one); the family is read from ``model`` (:func:`~dice_ray.policy.families.family_of`).

    Args:
        estimator: ``"tracerl"`` (:func:`tracerl_logprobs`), ``"coupled"`` (:func:`coupled_logprobs` with
            :func:`coupled_mask` of ``seed``) or ``"diffu_grpo"`` (:func:`diffu_grpo_logprobs`, prompt kept).
        model: the policy's transformers model (``dice_block`` attention; Qwen3 SDAR, Llama LLaDA, Qwen2
            Dream); grads flow.
        prompt_ids: LongTensor[P]; response_ids: LongTensor[G, R] (SDAR: R a multiple of ``block_size``).
        unmask_step: LongTensor[G, R], the trace (see :func:`tracerl_logprobs`); only ``tracerl`` reads it.
        response_mask: BoolTensor[G, R], True for the tokens to score.
        block_size: tokens a block (SDAR). mask_id: id of ``<|mask|>``.
        seed: the coupled mask's seed: pass the same seed for the old-policy and new-policy log-probs of a
            group. ``tracerl`` and ``diffu_grpo`` ignore it.
        canvas_len: LLaDA / Dream: the sampler's decoded length (``max_new_tokens``), >= R; None: R. SDAR
            ignores it, and so does ``tracerl`` given ``span_lens``.
        suffix_ids: LongTensor[S], LLaDA / Dream: the fixed tokens after an infilled span (every estimator);
            None or empty: none, the behaviour without a suffix. SDAR: must be empty (its prompt holds the scaffold).
        span_lens: LongTensor[G, N], LLaDA / Dream, ``tracerl`` only (the others score states the sampler never
            saw): each row's span length at every step (see :func:`tracerl_logprobs`); None: ``canvas_len``.
        rows: score only these rows of the group (a row chunk of the learner, ``cluster.learner_rows_per_chunk``;
            a slice of ``range(G)``), every pass (the prompt's too) run with those rows only; None: all G. What is
            drawn or sized for the group stays the group's: the coupled mask is drawn for ``[G, R]`` and cut, the
            padded length R and ``canvas_len`` are the group's (the learner passes the group's), so a row's
            log-probs are those the whole group's call gives it (up to floating-point rounding), whatever chunk
            it is scored in.
        passes: None: as many model calls as the data needs (a state that scores nothing is skipped); n: exactly
            n state passes (>= :func:`state_passes` of the rows scored), the prompt and clean passes of SDAR
            always, every pass in the output's autograd graph: the same calls for any rows given the same n (the
            learner's ranks under ZeRO-3). The log-probs are the same either way.

    Returns:
        FloatTensor[G, R] (fp32) log-probs, or [rows, R] for ``rows``; 0 where ``response_mask`` is False.
        Differentiable.

    Raises:
        ValueError: an unknown ``estimator``, an empty or stepped ``rows``, ``passes`` below
            :func:`state_passes`, or bad input (see the estimator's function).
    """
    mask = coupled_mask(tuple(response_ids.shape), seed) if estimator == "coupled" else None  # the group's
    if rows is not None:
        G = response_ids.shape[0] if response_ids.dim() == 2 else 0
        start, stop, step = rows.indices(G)
        if step != 1 or stop <= start:
            raise ValueError(f"rows: must be a non-empty slice of consecutive rows of the group's {G}, got {rows}")
        response_ids, unmask_step, response_mask = response_ids[rows], unmask_step[rows], response_mask[rows]
        if span_lens is not None:
            span_lens = span_lens[rows]
        if mask is not None:
            mask = mask[rows]
    if passes is not None and passes < (least := state_passes(estimator, unmask_step, response_mask)):
        raise ValueError(f"passes: {estimator} needs at least {least} state passes for these rows, got {passes}")
    if estimator == "tracerl":
        return tracerl_logprobs(model, prompt_ids, response_ids, unmask_step, response_mask, block_size, mask_id,
                                canvas_len=canvas_len, suffix_ids=suffix_ids, span_lens=span_lens, passes=passes)
    if estimator == "coupled":
        return coupled_logprobs(model, prompt_ids, response_ids, response_mask, block_size, mask_id, mask,
                                canvas_len=canvas_len, suffix_ids=suffix_ids, passes=passes)
    if estimator == "diffu_grpo":
        return diffu_grpo_logprobs(model, prompt_ids, response_ids, response_mask, block_size, mask_id,
                                   canvas_len=canvas_len, suffix_ids=suffix_ids, passes=passes)
    raise ValueError(f"estimator: must be one of {ESTIMATORS}, got {estimator!r}")
