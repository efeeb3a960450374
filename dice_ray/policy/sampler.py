"""Block-diffusion decoding with a block KV cache and low-confidence remasking (SDAR / Fast-dLLM).

A group of G samples of one prompt is decoded in one batch, alone or with other prompts' groups
(:func:`sample_groups`, :func:`sample_ids_batch`: prompts left-padded to the longest, each row attending its own
keys at its own RoPE positions, each group drawing from its own generator, so a group's samples do not depend on
what shares its batch). Each prompt is encoded once (one row a prompt) and its KV cache copied to its G rows.
Each response block starts fully masked (``<|mask|>``) and is denoised in steps; at each step the model predicts
every masked position, a token is drawn at each (temperature / top-k / top-p), and the most confident drafts are
kept (unmasked):

* ``static``: ``steps_per_block`` steps, ``block_size / steps_per_block`` tokens a step (remainder to the
  first steps), the highest-confidence ones (LLaDA / SDAR low-confidence remasking);
* ``dynamic``: every masked token whose confidence >= ``threshold``, at least the most confident one a step
  (Fast-dLLM's threshold parallel decoding; DICE: threshold 0.9).

Confidence is the probability of the drawn token under the sampling distribution (after temperature and
top-k / top-p); temperature 0 is greedy. When a block is complete it is re-run clean (merged with the first
step of the next block) to commit its keys/values to the cache, so the cache holds exactly what the
training pass (:mod:`dice_ray.policy.logprobs`) computes for clean blocks. A sample stops after the block
holding ``<|eos|>`` or at ``max_new_tokens`` (it stays in the batch, fully unmasked, until all have). On a
GPU the cached denoising forward is recorded as CUDA graphs and replayed (``sampling.cuda_graphs``,
:mod:`dice_ray.policy.graphs`): one launch for the forward instead of one a kernel.

For every response token the rollout records its ``unmask_step`` (0-based denoising step within its block)
and its behaviour log-prob (log-softmax of the temperature-1 logits at that step, at the chosen token):
TraceRL needs both.

The bidirectional families (LLaDA, Dream; :mod:`dice_ray.policy.families`) decode the whole masked response at
once with the same drawing and remasking pieces (:func:`sample_masked_ids`; :func:`sample_ids` and
:func:`sample_group` dispatch to it), and infill a masked span between a fixed prefix and suffix
(:func:`infill_ids`, :func:`infill_group`); Dream's logits are read one position to the left (:func:`span_logits`).
Their rollouts also record the span's length at every step (a grown infill span changes length while it is
decoded), so the TraceRL replay rebuilds every state the sampler saw (:attr:`Rollout.span_lengths`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from dice_ray.config import SamplingConfig
from dice_ray.policy.graphs import CachedForward
from dice_ray.policy.model import KVCache, block_mask, forward_hidden, prompt_blocks, token_logits
from dice_ray.policy.policy import DiffusionPolicy
from dice_ray.policy.samples import Rollout, RolloutGroup, SampleStats  # the return types, kept light for the driver


def transfer_schedule(block_size: int, steps: int) -> list[int]:
    """Tokens unmasked at each static step: ``block_size`` split over ``min(steps, block_size)`` steps.

    >>> transfer_schedule(4, 4), transfer_schedule(4, 2), transfer_schedule(5, 2)
    ([1, 1, 1, 1], [2, 2], [3, 2])
    """
    steps = min(steps, block_size)
    base, rem = divmod(block_size, steps)
    return [base + (1 if i < rem else 0) for i in range(steps)]


def draw_tokens(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
    generator: torch.Generator | Sequence[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token a position and its confidence.

    Args:
        logits: FloatTensor[..., V] (fp32).
        temperature: 0 = greedy (argmax), else softmax(logits / temperature).
        top_k, top_p: optional nucleus / top-k filtering applied before sampling.
        generator: torch.Generator on logits' device; or one per group of a batch of groups: ``logits``' first
            dimension splits into ``len(generator)`` equal parts, part ``i`` drawn from ``generator[i]`` exactly as
            alone (a group's draws do not depend on the batch), None: that part draws nothing (its generator does not
            advance; its tokens are the most likely ones, to be ignored).

    Raises:
        ValueError: generators that do not split the rows into equal parts.

    Returns:
        (LongTensor[...] tokens, FloatTensor[...] probability of each token under the sampling distribution).
    """
    if temperature == 0.0:
        probs = torch.softmax(logits, dim=-1)
        conf, tok = probs.max(dim=-1)
        return tok, conf
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= top_p  # keep the token that crosses top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    # exponential race (= Gumbel-max): argmax p_i / E_i, E_i ~ Exp(1), draws i with probability p_i;
    # ~5x faster than torch.multinomial on CPU for [16, 4096]
    if isinstance(generator, torch.Generator):
        u = torch.rand(probs.shape, generator=generator, device=probs.device, dtype=probs.dtype)
    else:
        if not generator or probs.shape[0] % len(generator):
            raise ValueError(f"generators ({len(generator)}): must split the {probs.shape[0]} rows into equal groups")
        part = (probs.shape[0] // len(generator), *probs.shape[1:])
        u = torch.cat([torch.rand(part, generator=g, device=probs.device, dtype=probs.dtype) if g is not None
                       else torch.full(part, 0.5, device=probs.device, dtype=probs.dtype) for g in generator])
    tok = (probs / -torch.log1p(-u)).argmax(dim=-1)
    conf = probs.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
    return tok, conf


def _choose(conf: torch.Tensor, masked: torch.Tensor, cfg: SamplingConfig, k_static: int) -> torch.Tensor:
    """BoolTensor[A, bs]: which masked positions to unmask this step (low-confidence remasking)."""
    conf = conf.masked_fill(~masked, float("-inf"))
    if cfg.remasking == "static":
        k = torch.clamp(masked.sum(-1), max=k_static)  # [A]
        order = conf.argsort(dim=-1, descending=True)
        ranks = torch.arange(conf.shape[-1], device=conf.device).expand_as(order)
        rank = torch.empty_like(order).scatter_(-1, order, ranks)
        return (rank < k[:, None]) & masked
    pick = (conf >= cfg.threshold) & masked
    best = torch.zeros_like(pick).scatter_(-1, conf.argmax(-1, keepdim=True), True) & masked
    return pick | best


def _decode_blocks(policy: DiffusionPolicy, prompts: list[list[int]], G: int, n_blocks: int, cfg: SamplingConfig,
                   generators: list[torch.Generator], kv_cache: bool = True):
    """The decoding loop of :func:`sample_ids` and :func:`sample_ids_batch`: ``len(prompts)`` groups of ``G`` rows in
    one batch (rows ``g * G .. g * G + G - 1``: group ``g``), per sample lists of per-block token / step / log-prob
    tensors.

    Prompts of different lengths are left-padded (``pad_id``) to the longest, ``P``, so every row's response starts
    at column ``P`` and the blocks, aligned to the prompt's end (:func:`prompt_blocks`), are the same columns for
    every row. Each row attends its own keys only (``[B, q, kv]`` masks: a padding key is never attended; a padding
    query attends itself, so its keys stay finite) and its RoPE positions are its own (column minus its padding), so
    a row computes what it computes alone, up to floating-point rounding. Group ``g``'s random draws come from
    ``generators[g]`` and only at the steps where one of its rows still has a masked position: exactly the draws it
    makes alone (:func:`draw_tokens`), whatever else shares the batch. Without padding (one group, or prompts of one
    length) positions and masks stay ``[q]`` / ``[q, kv]``, shared by the rows.

    With the cache and ``cfg.cuda_graphs`` on a GPU, the denoising forwards are replayed CUDA graphs
    (:class:`~dice_ray.policy.graphs.CachedForward`; with padding its inputs are per-row positions and masks). In
    every mode a row that finishes stays in the batch until every row has, fully unmasked (pad tokens), so it adds
    no denoising steps and its later blocks are not returned: the cache buffers a graph recorded stay valid, and the
    random draws of the other rows do not depend on when it finished, so graphs and eager give the same samples.
    The cost: a finished row is still computed (little at decoding batch sizes, where the GEMMs are bound by reading
    the weights).

    Returns:
        (tokens, unmask steps, behaviour log-probs: per sample a list of LongTensor / LongTensor /
        FloatTensor ``[block_size]``, one per returned block; model forwards run, prefill included).
    """
    model, bs, mask_id = policy.model, policy.block_size, policy.mask_id
    device, N = policy.device, len(prompts)
    B, P = N * G, max(map(len, prompts))
    k_sched = transfer_schedule(bs, cfg.steps_per_block)
    graphs = kv_cache and cfg.cuda_graphs and device.type == "cuda"

    # left padding: group g's prompt starts at column off[g]; its rows see no key before it, and their positions
    # are the column minus off[g] (padding columns: position 0, never attended)
    off = torch.tensor([P - len(p) for p in prompts], device=device)
    padded = bool(off.any())
    prompt = torch.full((N, P), policy.pad_id, dtype=torch.long, device=device)
    for g, p in enumerate(prompts):
        prompt[g, P - len(p):] = torch.tensor(p, dtype=torch.long, device=device)
    off_rows = off.repeat_interleave(G)

    # committed tokens never exceed the prompt and all blocks; a step adds at most the finished block and this one
    cache = KVCache(capacity=P + (n_blocks + 1) * bs)

    def rows_view(pos: torch.Tensor, mask: torch.Tensor, offs: torch.Tensor, q0: int):
        """Positions ``[q]`` and mask ``[q, kv]`` of a pass whose queries are columns ``q0 ..``, as they are without
        padding, else each row's own, ``[rows, q]`` / ``[rows, q, kv]``, for rows whose prompts start at ``offs``."""
        if not padded:
            return pos, mask
        q, kv = mask.shape
        cols = torch.arange(kv, device=device)
        own = mask[None] & (cols[None] >= offs[:, None])[:, None, :]  # no row attends a padding key
        if q0 < P:  # a padding query attends only itself: its keys and values stay finite
            qcols = q0 + torch.arange(q, device=device)
            pad_q = qcols[None] < offs[:, None]
            own = own | (pad_q[:, :, None] & (cols[None] == qcols[:, None])[None])
        return (pos[None] - offs[:, None]).clamp(min=0), own

    zeros = torch.zeros(P, dtype=torch.long, device=device)
    p_block = prompt_blocks(P, bs, device)
    forwards = 0
    if kv_cache:
        cache.next_slots(P, device)
        pos, mask = rows_view(torch.arange(P, device=device), cache.pad_mask(block_mask(p_block, zeros, p_block, zeros)),
                              off, 0)
        forward_hidden(model, prompt, pos, mask, cache)
        cache.commit(P)
        cache.expand(G)
        forwards = 1
        cached_forward = CachedForward(model, cache, graphs)
    done = prompt.repeat_interleave(G, dim=0)  # kv_cache=False: prompt + finished blocks of every row, re-run every step

    live = [True] * B  # rows still decoding (a finished row stays in the batch, fully unmasked: pad tokens)
    out_tok: list[list[torch.Tensor]] = [[] for _ in range(B)]
    out_step: list[list[torch.Tensor]] = [[] for _ in range(B)]
    out_lp: list[list[torch.Tensor]] = [[] for _ in range(B)]
    prev: torch.Tensor | None = None  # [B, bs] finished block not yet committed to the cache
    # block / copy ids of the committed cache: prompt blocks <= 0, response block j = j + 1, all clean
    k_block = p_block.clone()

    for b in range(n_blocks):
        x = torch.full((B, bs), mask_id, dtype=torch.long, device=device)
        if not all(live):  # finished rows: nothing masked, so they add no denoising steps
            x[torch.tensor([not a for a in live], device=device)] = policy.pad_id
        step_of = torch.full((B, bs), -1, dtype=torch.long, device=device)
        lp_of = torch.zeros((B, bs), device=device)
        cur = torch.full((bs,), b + 1, dtype=torch.long, device=device)
        step = 0
        while True:
            masked = x == mask_id
            need = masked.view(N, -1).any(-1).tolist()  # groups still decoding this block: they draw this step
            if not any(need):
                break
            if not kv_cache:  # no cache (baseline): the whole sequence, this block last, block-causal
                blocks = torch.cat([p_block, torch.arange(done.shape[1] - P + bs, device=device) // bs + 1])
                ids, clean = torch.cat([done, x], dim=1), torch.zeros_like(blocks)
                pos, mask = rows_view(torch.arange(blocks.numel(), device=device),
                                      block_mask(blocks, clean, blocks, clean), off_rows, 0)
                h = forward_hidden(model, ids, pos, mask)
            else:
                if prev is not None:  # commit the finished block while denoising this one
                    q_block = torch.cat([cur - 1, cur])
                    q_copy = torch.cat([torch.zeros(bs), torch.ones(bs)]).long().to(device)
                    ids, keep = torch.cat([prev, x], dim=1), bs
                else:
                    q_block, q_copy, ids, keep = cur, torch.ones(bs, dtype=torch.long, device=device), x, 0
                k_copy = torch.cat([torch.zeros_like(k_block), q_copy])
                mask = cache.pad_mask(block_mask(q_block, q_copy, torch.cat([k_block, q_block]), k_copy))
                pos = P + (q_block - 1) * bs + torch.arange(q_block.numel(), device=device) % bs
                pos, mask = rows_view(pos, mask, off_rows, len(cache))
                cache.next_slots(q_block.numel(), device)
                h = cached_forward(ids, pos, mask)
                cache.commit(keep)
            forwards += 1
            if prev is not None:
                k_block = torch.cat([k_block, cur - 1])
                prev = None
            logits = token_logits(model, h[:, -bs:], mask_id)  # [B, bs, V] fp32
            gens = generators[0] if N == 1 else [g if n else None for g, n in zip(generators, need)]
            tok, conf = draw_tokens(logits, cfg.temperature, cfg.top_k, cfg.top_p, gens)
            lp = torch.log_softmax(logits, dim=-1).gather(-1, tok.unsqueeze(-1)).squeeze(-1)
            pick = _choose(conf, masked, cfg, k_sched[min(step, len(k_sched) - 1)])
            x = torch.where(pick, tok, x)
            step_of = torch.where(pick, step, step_of)
            lp_of = torch.where(pick, lp, lp_of)
            step += 1
        for r in range(B):
            if live[r]:
                out_tok[r].append(x[r])
                out_step[r].append(step_of[r])
                out_lp[r].append(lp_of[r])
        ended = (x == policy.eos_id).any(-1).tolist()
        live = [a and not e for a, e in zip(live, ended)]
        if not any(live):
            break
        if not kv_cache:
            done = torch.cat([done, x], dim=1)
        prev = x if kv_cache else None

    return out_tok, out_step, out_lp, forwards


def sample_ids(
    policy: DiffusionPolicy,
    prompt_ids: list[int],
    num_samples: int,
    cfg: SamplingConfig,
    generator: torch.Generator,
    kv_cache: bool = True,
) -> tuple[list[list[int]], list[list[int]], list[list[float]], SampleStats]:
    """Block-diffusion decoding of ``num_samples`` responses to one prompt (token level).

    ``kv_cache=False`` re-runs the prompt and every committed block at each step instead of caching their
    keys/values: the same tokens up to floating-point rounding, much slower (the baseline of
    ``benchmarks/rollout_throughput.py``).

    Returns:
        (response_ids, unmask_step, behaviour_logprobs, stats): per sample, lists of equal length, a
        multiple of ``block_size``.

    Raises:
        ValueError: empty prompt, ``num_samples < 1``, or prompt + max_new_tokens beyond the model's
            ``max_position_embeddings``.
    """
    if policy.family != "sdar":  # LLaDA / Dream: whole-response masked diffusion
        if not prompt_ids:
            raise ValueError("prompt_ids: must not be empty")
        if num_samples < 1:
            raise ValueError(f"num_samples={num_samples}: must be >= 1")
        return sample_masked_ids(policy, [list(prompt_ids)] * num_samples, cfg, generator)
    groups, stats = sample_ids_batch(policy, [prompt_ids], num_samples, cfg, [generator], kv_cache)
    return (*groups[0], stats)


@torch.inference_mode()
def sample_ids_batch(
    policy: DiffusionPolicy,
    prompts: list[list[int]],
    num_samples: int,
    cfg: SamplingConfig,
    generators: list[torch.Generator],
    kv_cache: bool = True,
) -> tuple[list[tuple[list[list[int]], list[list[int]], list[list[float]]]], SampleStats]:
    """SDAR block-diffusion decoding of ``num_samples`` responses to each of several prompts, in one batch.

    The prompts may differ in length (left-padded, each row attending its own keys at its own positions:
    :func:`_decode_blocks`); prompt ``i``'s draws come from ``generators[i]`` alone, so its responses are those of
    ``sample_ids(policy, prompts[i], num_samples, cfg, generators[i])`` up to the floating-point rounding of batched
    GEMMs and padded attention (on CPU in fp32 the same tokens in practice; log-probs within ~1e-5).

    Returns:
        (per prompt ``(response_ids, unmask_step, behaviour_logprobs)`` as :func:`sample_ids` returns them, the
        batch's :class:`SampleStats`: ``num_samples`` = rows, ``prompt_tokens`` = the prompts' sum).

    Raises:
        ValueError: no prompt, an empty prompt, ``num_samples < 1``, as many generators as prompts not given, a
            non-SDAR policy, or a prompt + max_new_tokens beyond the model's ``max_position_embeddings``.
    """
    model, bs, G = policy.model, policy.block_size, num_samples
    if policy.family != "sdar":
        raise ValueError(f"sample_ids_batch: SDAR block decoding only (model.family {policy.family!r}: sample_group)")
    if not prompts:
        raise ValueError("prompts: must not be empty")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("prompt_ids: must not be empty")
    if G < 1:
        raise ValueError(f"num_samples={G}: must be >= 1")
    if len(generators) != len(prompts):
        raise ValueError(f"generators ({len(generators)}): one a prompt ({len(prompts)})")
    n_blocks = cfg.max_new_tokens // bs
    P = max(map(len, prompts))
    if P + n_blocks * bs > policy.model_cfg.max_position_embeddings:
        raise ValueError(
            f"prompt ({P} tokens) + max_new_tokens ({n_blocks * bs}) exceeds max_position_embeddings="
            f"{policy.model_cfg.max_position_embeddings}"
        )
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    try:
        out_tok, out_step, out_lp, forwards = _decode_blocks(policy, prompts, G, n_blocks, cfg, generators, kv_cache)
    finally:
        model.train(was_training)
    responses = [torch.cat(t).tolist() for t in out_tok]
    steps = [torch.cat(t).tolist() for t in out_step]
    lps = [torch.cat(t).tolist() for t in out_lp]
    seconds = time.perf_counter() - t0
    new = sum(map(len, responses))
    stats = SampleStats(len(prompts) * G, sum(map(len, prompts)), new, forwards, seconds, new / max(seconds, 1e-9))
    per = [(responses[i * G:(i + 1) * G], steps[i * G:(i + 1) * G], lps[i * G:(i + 1) * G]) for i in range(len(prompts))]
    return per, stats


def sample_group(
    policy: DiffusionPolicy, prompt: str, num_samples: int, cfg: SamplingConfig, seed: int
) -> RolloutGroup:
    """Sample a group of ``num_samples`` rollouts for ``prompt`` (SDAR block diffusion, Fast-dLLM remasking;
    LLaDA / Dream: :func:`sample_masked_ids`'s draws, the response cut after its first ``eos``, with the
    ``tail_ids`` and ``span_lengths`` the TraceRL replay needs).

    Deterministic for a given policy, prompt, cfg and seed (on one device).

    Returns:
        :class:`RolloutGroup` (a ``list[Rollout]``) with ``.stats`` (:class:`SampleStats`, tokens/s).

    Raises:
        ValueError: see :func:`sample_ids`.
    """
    return sample_groups(policy, [prompt], num_samples, cfg, [seed])[0]


def sample_groups(
    policy: DiffusionPolicy, prompts: list[str], num_samples: int, cfg: SamplingConfig, seeds: list[int]
) -> list[RolloutGroup]:
    """A group of ``num_samples`` rollouts for each prompt, group ``i`` seeded by ``seeds[i]``: SDAR decodes every
    group in one batch (:func:`sample_ids_batch`; the caller bounds the batch, ``sampling.max_batch_rows``), each
    group's samples those :func:`sample_group` draws alone up to floating-point rounding; LLaDA / Dream sample one
    group after another (:func:`sample_group`; their decoding drops finished rows as it goes, one generator a call).

    Each group's ``.stats`` is its share of the batch: its own prompt and new tokens, the batch's forwards, and the
    batch's seconds times its share of the rows (the shares of a batch add up to its wall time).

    Raises:
        ValueError: ``seeds`` not one a prompt; see :func:`sample_ids_batch`.
    """
    if len(seeds) != len(prompts):
        raise ValueError(f"seeds ({len(seeds)}): one a prompt ({len(prompts)})")
    if policy.family != "sdar":
        out = []
        for prompt, seed in zip(prompts, seeds):
            prompt_ids = policy.encode(prompt)
            if not prompt_ids:
                raise ValueError("prompt_ids: must not be empty")
            out.append(_span_group(policy, prompt_ids, [], num_samples, cfg, seed, cfg.max_new_tokens, None,
                                   stop_at_eos=True))
        return out
    ids = [policy.encode(p) for p in prompts]
    gens = [torch.Generator(device=policy.device).manual_seed(seed) for seed in seeds]
    per, stats = sample_ids_batch(policy, ids, num_samples, cfg, gens)
    out = []
    for prompt_ids, (responses, steps, lps) in zip(ids, per):
        group = RolloutGroup()
        for resp, st, lp in zip(responses, steps, lps):
            cut = resp.index(policy.eos_id) if policy.eos_id in resp else len(resp)
            group.append(Rollout(list(prompt_ids), resp, st, lp, policy.decode(resp[:cut]), cut < len(resp)))
        new = sum(len(r.response_ids) for r in group)
        seconds = stats.seconds * num_samples / stats.num_samples
        group.stats = SampleStats(num_samples, len(prompt_ids), new, stats.forwards, seconds, new / max(seconds, 1e-9))
        out.append(group)
    return out


# ---- bidirectional families (LLaDA, Dream): whole-response decoding and prefix / suffix infilling -------------


def span_logits(policy: DiffusionPolicy, rows: list[torch.Tensor], starts: list[int], lengths: list[int]) -> torch.Tensor:
    """Logits predicting the span tokens of each row under full (bidirectional) attention, one forward pass.

    Rows are right-padded to one length; a padded key is never attended (a pad query attends its row's real
    keys, so no row of the mask is empty and nothing is NaN). The logits of span position ``j`` of row ``r`` are read at sequence position
    ``starts[r] + j - policy.logit_shift``: the position itself for LLaDA, the one before it for Dream.

    Args:
        rows: LongTensor[T_r] token ids of each row (mask token where masked).
        starts, lengths: where each row's span begins and how long it is (tokens).

    Returns:
        FloatTensor[B, S, V] (fp32, mask token excluded), ``S = max(lengths)``; entries past a row's length are
        logits of clamped positions, to be ignored.

    Raises:
        ValueError: a span starting at 0 under a shifted family (Dream needs a token before the span).
    """
    h = span_hidden(policy.model, rows, starts, lengths, policy.logit_shift, policy.pad_id)
    return token_logits(policy.model, h, policy.mask_id)


def span_hidden(model, rows: list[torch.Tensor], starts: list[int], lengths: list[int], shift: int,
                pad_id: int) -> torch.Tensor:
    """The final hidden states :func:`span_logits` reads its logits from, for a bare model: the one full-attention
    forward of the bidirectional families, shared by the sampler, the RL log-probs
    (:mod:`dice_ray.policy.logprobs`: the learner sees the sampler's own layout) and SFT, which project only the
    positions they need (``[n, V]`` logits instead of ``[B, S, V]``).

    Args:
        model: a LLaDA / Dream transformers model (``dice_block`` attention).
        rows, starts, lengths: as in :func:`span_logits` (rows on the model's device).
        shift: :func:`~dice_ray.policy.families.logit_shift` of the family (Dream 1: span position ``j`` is read
            at ``starts[r] + j - 1``; LLaDA 0).
        pad_id: the id right-padding fills in (never attended, its outputs never read: any valid id).

    Returns:
        FloatTensor[B, S, H] in the model's dtype, ``S = max(lengths)``.

    Raises:
        ValueError: as :func:`span_logits`.
    """
    if shift and min(starts) < shift:
        raise ValueError("prompt / prefix: must not be empty for a shifted family (Dream reads position i-1)")
    device = rows[0].device
    lens = torch.tensor([r.numel() for r in rows], device=device)
    T, S = int(lens.max()), max(lengths)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long, device=device)
    for i, r in enumerate(rows):
        ids[i, : r.numel()] = r
    ar = torch.arange(T, device=device)
    valid = ar[None] < lens[:, None]
    h = forward_hidden(model, ids, ar, valid[:, None, :].expand(-1, T, -1))  # a view: no [B, T, T] copy
    at = torch.tensor(starts, device=device)[:, None] + torch.arange(S, device=device)[None] - shift
    at = at.clamp(0, T - 1)
    return h.gather(1, at[..., None].expand(-1, -1, h.shape[-1]))


def _denoise_spans(policy: DiffusionPolicy, prefixes: list[list[int]], suffixes: list[list[int]],
                   span_lens: list[int], cfg: SamplingConfig, generator: torch.Generator, stop_at_eos: bool,
                   grow_to: int | None, keep_tail: bool = False):
    """The decoding loop of the bidirectional families: row ``r`` is ``prefix ‖ span ‖ suffix``, span masked.

    Each step one forward over the active rows; the span's masked positions are drawn (:func:`draw_tokens`) and
    the most confident kept (:func:`_choose`; static: ``transfer_schedule(block_size, steps_per_block)`` tokens a
    step, cycled). ``stop_at_eos``: positions after the first unmasked ``eos`` are never decoded and the span is
    cut after it once everything before it is unmasked (``keep_tail``: cut after the last position decoded
    instead, ``<|mask|>`` and step -1 where never decoded). ``grow_to``: a span filled without ``eos`` gets
    ``block_size`` more masked positions (before the suffix) until it reaches ``grow_to`` tokens.

    Returns:
        (spans, steps, logprobs, span_lengths, forwards): per row LongTensor[n_r] tokens, LongTensor[n_r] step
        (0-based, over the whole decoding) at which each was unmasked, FloatTensor[n_r] temperature-1 log-prob at
        that step, list[int] the span's length (tokens) at each of the row's steps (:attr:`Rollout.span_lengths`).
    """
    device, mask_id, eos_id, bs = policy.device, policy.mask_id, policy.eos_id, policy.block_size
    k_sched = transfer_schedule(bs, cfg.steps_per_block)
    pre = [torch.tensor(p, dtype=torch.long, device=device) for p in prefixes]
    suf = [torch.tensor(s, dtype=torch.long, device=device) for s in suffixes]
    span = [torch.full((n,), mask_id, dtype=torch.long, device=device) for n in span_lens]
    step_of = [torch.full((n,), -1, dtype=torch.long, device=device) for n in span_lens]
    lp_of = [torch.zeros(n, device=device) for n in span_lens]
    trace: list[list[int]] = [[] for _ in span_lens]  # per row, the span's length at each of its steps
    active, step, forwards = list(range(len(prefixes))), 0, 0

    def todo(x: torch.Tensor, in_span: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions still to decode [A, S], index of the first unmasked eos or S [A])."""
        S = x.shape[1]
        is_eos = (x == eos_id) & in_span
        first = torch.where(is_eos.any(-1), is_eos.int().argmax(-1), torch.full_like(is_eos[:, 0], S, dtype=torch.long))
        need = in_span & (x == mask_id)
        if stop_at_eos:
            need &= torch.arange(S, device=device)[None] < first[:, None]
        return need, first

    while active:
        lengths = [span[r].numel() for r in active]
        for r, n in zip(active, lengths):
            trace[r].append(n)
        logits = span_logits(policy, [torch.cat([pre[r], span[r], suf[r]]) for r in active],
                             [pre[r].numel() for r in active], lengths)
        forwards += 1
        S = logits.shape[1]
        in_span = torch.arange(S, device=device)[None] < torch.tensor(lengths, device=device)[:, None]
        x = torch.full((len(active), S), mask_id, dtype=torch.long, device=device)
        st = torch.full_like(x, -1)
        lp_all = torch.zeros(x.shape, device=device)
        for i, r in enumerate(active):
            x[i, : lengths[i]], st[i, : lengths[i]], lp_all[i, : lengths[i]] = span[r], step_of[r], lp_of[r]
        need, _ = todo(x, in_span)
        tok, conf = draw_tokens(logits, cfg.temperature, cfg.top_k, cfg.top_p, generator)
        lp = torch.log_softmax(logits, dim=-1).gather(-1, tok.unsqueeze(-1)).squeeze(-1)
        pick = _choose(conf, need, cfg, k_sched[step % len(k_sched)])
        x, st, lp_all = torch.where(pick, tok, x), torch.where(pick, step, st), torch.where(pick, lp, lp_all)
        need, first = todo(x, in_span)
        still = []
        for i, r in enumerate(active):
            n = lengths[i]
            span[r], step_of[r], lp_of[r] = x[i, :n], st[i, :n], lp_all[i, :n]
            if need[i].any():
                still.append(r)
            elif stop_at_eos and first[i] < n:  # finished at the end marker: cut after it
                e = int(first[i]) + 1
                if keep_tail:  # ... or after the last position decoded beyond it
                    e = int((step_of[r] >= 0).nonzero().max()) + 1
                span[r], step_of[r], lp_of[r] = span[r][:e], step_of[r][:e], lp_of[r][:e]
            elif grow_to is not None and n < grow_to:  # filled without an end marker: one more block
                g = min(bs, grow_to - n)
                span[r] = torch.cat([span[r], torch.full((g,), mask_id, dtype=torch.long, device=device)])
                step_of[r] = torch.cat([step_of[r], torch.full((g,), -1, dtype=torch.long, device=device)])
                lp_of[r] = torch.cat([lp_of[r], torch.zeros(g, device=device)])
                still.append(r)
        active = still
        step += 1
    return span, step_of, lp_of, trace, forwards


def _run_spans(policy: DiffusionPolicy, prefixes: list[list[int]], suffixes: list[list[int]], span_lens: list[int],
               cfg: SamplingConfig, generator: torch.Generator, stop_at_eos: bool, grow_to: int | None,
               keep_tail: bool = False):
    """Validate, run :func:`_denoise_spans` in inference mode, convert to lists and time it: (span ids, unmask
    steps, behaviour log-probs, span lengths a step, stats)."""
    if policy.family == "sdar":
        raise ValueError(
            "policy: prefix/suffix infilling and whole-response decoding need a bidirectional family "
            "(model.family 'llada' or 'dream'); SDAR decodes block by block (sample_ids)"
        )
    if not prefixes:
        raise ValueError("prompts / prefixes: must not be empty")
    longest = max(len(p) + len(s) for p, s in zip(prefixes, suffixes)) + max(grow_to or 0, max(span_lens))
    if longest > policy.model_cfg.max_position_embeddings:
        raise ValueError(
            f"prefix + span + suffix ({longest} tokens) exceeds max_position_embeddings="
            f"{policy.model_cfg.max_position_embeddings}"
        )
    model = policy.model
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            span, steps, lps, trace, forwards = _denoise_spans(policy, prefixes, suffixes, span_lens, cfg, generator,
                                                               stop_at_eos, grow_to, keep_tail)
    finally:
        model.train(was_training)
    seconds = time.perf_counter() - t0
    out = [t.tolist() for t in span], [t.tolist() for t in steps], [t.tolist() for t in lps]
    new = sum(int((t >= 0).sum()) for t in steps)  # decoded tokens (a kept tail's never-decoded positions: -1)
    stats = SampleStats(len(prefixes), sum(map(len, prefixes)), new, forwards, seconds, new / max(seconds, 1e-9))
    return (*out, trace, stats)


def _span_group(policy: DiffusionPolicy, prefix: list[int], suffix: list[int], num_samples: int, cfg: SamplingConfig,
                seed: int, first: int, grow_to: int | None, stop_at_eos: bool) -> RolloutGroup:
    """A group of LLaDA / Dream rollouts of ``prefix ‖ span ‖ suffix`` (:func:`_denoise_spans`, span of ``first``
    tokens, grown to ``grow_to``) with what the TraceRL replay needs: the tail decoded after the first ``eos``
    (``stop_at_eos``; a fixed span is response throughout) and the span's length at every step."""
    if num_samples < 1:
        raise ValueError(f"num_samples={num_samples}: must be >= 1")
    gen = torch.Generator(device=policy.device).manual_seed(seed)
    spans, steps, lps, trace, stats = _run_spans(policy, [prefix] * num_samples, [suffix] * num_samples,
                                                 [first] * num_samples, cfg, gen, stop_at_eos, grow_to,
                                                 keep_tail=stop_at_eos)
    group = RolloutGroup()
    for span, st, lp, lengths in zip(spans, steps, lps, trace):
        cut = span.index(policy.eos_id) if policy.eos_id in span else len(span)
        end = min(cut + 1, len(span)) if stop_at_eos else len(span)
        group.append(Rollout(list(prefix), span[:end], st[:end], lp[:end], policy.decode(span[:cut]), cut < len(span),
                             list(suffix), tail_ids=span[end:], tail_steps=st[end:], span_lengths=lengths))
    group.stats = stats
    return group


def sample_masked_ids(
    policy: DiffusionPolicy, prompts: list[list[int]], cfg: SamplingConfig, generator: torch.Generator,
) -> tuple[list[list[int]], list[list[int]], list[list[float]], SampleStats]:
    """Masked-diffusion decoding of one response a prompt for LLaDA / Dream (batched prompts of any lengths).

    LLaDA's low-confidence remasking (Nie et al. 2025, Alg. 5) over the whole response: ``max_new_tokens``
    masked positions after the prompt, all attended bidirectionally; each step draws every needed masked
    position and keeps the most confident (static: ``transfer_schedule(block_size, steps_per_block)`` tokens a
    step, cycled, the same rate as SDAR's; dynamic: every draw with confidence >= ``threshold``, at least one,
    Fast-dLLM). A response ends at its first ``eos``: positions after it are not decoded, and it stops once the
    tokens before it are unmasked. Batched rows are right-padded and padding is never attended, so a batch
    gives each row what it gets alone (greedy). :func:`sample_group` also keeps, for the TraceRL replay, the
    positions after the first ``eos`` that were decoded before it (:attr:`Rollout.tail_ids`) and the span's
    length at every step (:attr:`Rollout.span_lengths`).

    Returns:
        (response_ids, unmask_step, behaviour_logprobs, stats): per prompt, lists of equal length (up to and
        including the first ``eos``, else ``max_new_tokens``); ``unmask_step``
        counts steps over the whole response (not per block). ``stats.prompt_tokens`` sums the prompts.

    Raises:
        ValueError: an SDAR policy, an empty prompt, or prompt + max_new_tokens beyond max_position_embeddings.
    """
    if any(len(p) == 0 for p in prompts):
        raise ValueError("prompt_ids: must not be empty")
    ids, steps, lps, _, stats = _run_spans(policy, prompts, [[] for _ in prompts], [cfg.max_new_tokens] * len(prompts),
                                           cfg, generator, stop_at_eos=True, grow_to=None)
    return ids, steps, lps, stats


def _infill_span(policy: DiffusionPolicy, cfg: SamplingConfig, span_len: int | None) -> tuple[int, int | None]:
    """(first span length, length to grow to or None) of an infill: ``span_len`` fixed, or (None) grown from
    ``block_size`` to ``cfg.max_new_tokens``; ValueError for ``span_len < 1``."""
    if span_len is not None and span_len < 1:
        raise ValueError(f"span_len={span_len}: must be >= 1 (or None to grow the span)")
    if span_len is None:
        return min(policy.block_size, cfg.max_new_tokens), cfg.max_new_tokens
    return span_len, None


def infill_ids(
    policy: DiffusionPolicy,
    prefixes: list[list[int]],
    suffixes: list[list[int]],
    cfg: SamplingConfig,
    generator: torch.Generator,
    span_len: int | None = None,
) -> tuple[list[list[int]], list[list[int]], list[list[float]], SampleStats]:
    """Prefix / suffix infilling for LLaDA / Dream: fixed tokens around a masked span (DICE's infilling phase).

    Row ``r`` is ``prefixes[r] ‖ span ‖ suffixes[r]``; only the span is decoded (as in
    :func:`sample_masked_ids`), the prefix and suffix stay exactly as given and are attended both ways.

    * ``span_len`` given: the span has exactly ``span_len`` tokens, every one decoded (an ``eos`` inside is kept).
    * ``span_len=None`` (grown): the span starts at ``block_size`` masked tokens; when it is filled without an
      ``eos`` (the end marker) it gets ``block_size`` more before the suffix, up to ``cfg.max_new_tokens``; once
      an ``eos`` is unmasked the span ends there (tokens after it are dropped) when everything before it is
      unmasked.

    Returns:
        (span_ids, unmask_step, behaviour_logprobs, stats): per row, lists of equal length (grown spans include
        their ``eos`` when they have one).

    Raises:
        ValueError: an SDAR policy, ``span_len < 1``, prefixes and suffixes of different counts, an empty prefix
            for Dream, or a sequence beyond max_position_embeddings.
    """
    if len(prefixes) != len(suffixes):
        raise ValueError(f"prefixes ({len(prefixes)}) and suffixes ({len(suffixes)}): must be as many")
    first, grow_to = _infill_span(policy, cfg, span_len)
    spans, steps, lps, _, stats = _run_spans(policy, prefixes, suffixes, [first] * len(prefixes), cfg, generator,
                                             stop_at_eos=grow_to is not None, grow_to=grow_to)
    return spans, steps, lps, stats


def infill_group(
    policy: DiffusionPolicy, prefix: str, suffix: str, num_samples: int, cfg: SamplingConfig, seed: int,
    span_len: int | None = None,
) -> RolloutGroup:
    """Sample ``num_samples`` infills of the span between ``prefix`` and ``suffix`` (:func:`infill_ids`, the same
    draws for the same seed).

    Deterministic for a given policy, prefix, suffix, cfg and seed (on one device).

    Returns:
        :class:`RolloutGroup` of :class:`Rollout` with ``prompt_ids`` = the prefix, ``suffix_ids`` = the suffix,
        ``response_ids`` = the span (a grown span: up to and including its first ``eos``, the positions decoded
        after it in ``tail_ids``), ``span_lengths`` = the span's length at every step; ``text`` is the span up to
        its first ``eos``.

    Raises:
        ValueError: ``num_samples < 1``; see :func:`infill_ids`.
    """
    first, grow_to = _infill_span(policy, cfg, span_len)
    return _span_group(policy, policy.encode(prefix), policy.encode(suffix), num_samples, cfg, seed, first, grow_to,
                       stop_at_eos=grow_to is not None)
