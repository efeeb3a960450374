"""The three RL log-prob estimators against brute-force enumeration on a tiny model and vocabulary.

Brute force: for each state the estimator claims to score a token in, one plain block-causal forward of the
concrete sequence (prompt ‖ visible context ‖ state), no KV cache, no x_t ‖ x_0 copies, and the token's
probability by explicit float64 normalisation over the vocabulary (the mask token excluded).
"""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from dice_ray.cluster.learner import Learner, TrainGroup, estimator_seed
from dice_ray.config import DiceConfig, ModelConfig, RLConfig
from dice_ray.policy.logprobs import (
    coupled_logprobs,
    coupled_mask,
    diffu_grpo_logprobs,
    response_logprobs,
    tracerl_logprobs,
)
from dice_ray.policy.model import block_mask, build_model, forward_hidden
from _helpers import PlainEngine, coupled_expectation_and_draws

V, MASK, BS = 6, 5, 2  # tokens 0..4 (0 = pad), 5 = <|mask|>; blocks of 2
TINY = ModelConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=8, max_position_embeddings=128, block_size=BS)
PROMPT = torch.tensor([3, 1, 4, 2])


def _model(seed: int = 0):
    torch.manual_seed(seed)
    model = build_model(TINY, V, 0).eval()
    with torch.no_grad():  # sharpen the random model so the conditioning state changes log-probs visibly
        model.model.norm.weight.mul_(20.0)
    return model


def _brute(model, prompt: torch.Tensor, visible: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(targets[j] | prompt ‖ visible) at each response position j (visible may hold <|mask|>).

    One block-causal forward of the concrete sequence; probabilities normalised by hand in float64.
    """
    P, n = prompt.numel(), visible.numel()
    seq = torch.cat([prompt, visible])
    blocks = torch.cat([-((P - 1 - torch.arange(P)) // BS), torch.arange(n) // BS + 1])
    clean = torch.zeros(P + n, dtype=torch.long)
    with torch.no_grad():
        h = forward_hidden(model, seq[None], torch.arange(P + n), block_mask(blocks, clean, blocks, clean))[0, P:]
        logits = model.lm_head(h).double()
    w = (logits - logits.max(-1, keepdim=True).values).exp()
    w[:, MASK] = 0.0
    return (w.gather(-1, targets[:, None])[:, 0] / w.sum(-1)).log().float()


def _trace(G: int, n_blocks: int, seed: int):
    """Random responses and valid unmask traces (each block: a random order cut into >= 1-token steps)."""
    gen = torch.Generator().manual_seed(seed)
    R = n_blocks * BS
    resp = torch.randint(1, MASK, (G, R), generator=gen)
    step = torch.zeros(G, R, dtype=torch.long)
    for g, b in itertools.product(range(G), range(n_blocks)):
        order = torch.randperm(BS, generator=gen)
        parallel = bool(torch.rand((), generator=gen) < 0.3)  # both tokens of the block in one step
        step[g, b * BS + order] = torch.zeros(BS, dtype=torch.long) if parallel else torch.arange(BS)
    return resp, step


def test_tracerl_equals_brute_force_over_the_samplers_states():
    model = _model()
    G, nb = 4, 2
    resp, step = _trace(G, nb, seed=1)
    valid = torch.ones(G, nb * BS, dtype=torch.bool)
    valid[3, BS:] = False  # row 3: one block shorter (a padding block)
    valid[2, BS + 1] = False  # row 2: a token after <|eos|> inside a scored block: part of the state, not scored
    got = tracerl_logprobs(model, PROMPT, resp, step, valid, BS, MASK)
    want = torch.zeros_like(got)
    for g, b in itertools.product(range(G), range(nb)):
        blk = slice(b * BS, (b + 1) * BS)
        for s in range(BS):  # the sampler's state before step s: tokens of earlier steps visible
            state = torch.where(step[g, blk] < s, resp[g, blk], torch.full((BS,), MASK))
            lp = _brute(model, PROMPT, torch.cat([resp[g, : b * BS], state]), resp[g, : (b + 1) * BS])[-BS:]
            here = (step[g, blk] == s) & valid[g, blk]
            want[g, blk] = torch.where(here, lp, want[g, blk])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (got[~valid] == 0).all()
    # the test can fail: the state matters (all-masked block states give other values)
    blind = tracerl_logprobs(model, PROMPT, resp, torch.zeros_like(step), valid, BS, MASK)
    assert (blind - got)[valid & (step > 0)].abs().max() > 1e-3


def test_diffu_grpo_equals_brute_force_with_the_response_fully_masked():
    model = _model()
    resp, step = _trace(3, 2, seed=2)
    valid = torch.ones_like(resp, dtype=torch.bool)
    valid[1, -1] = False
    got = response_logprobs("diffu_grpo", model, PROMPT, resp, step, valid, BS, MASK, seed=123)
    all_masked = torch.full((resp.shape[1],), MASK)
    want = torch.stack([_brute(model, PROMPT, all_masked, r) for r in resp]) * valid
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # d1's prompt masking at p = 1: every prompt token is <|mask|> too
    got_p1 = diffu_grpo_logprobs(model, PROMPT, resp, valid, BS, MASK, p_mask_prompt=1.0, seed=0)
    want_p1 = torch.stack([_brute(model, torch.full_like(PROMPT, MASK), all_masked, r) for r in resp]) * valid
    torch.testing.assert_close(got_p1, want_p1, atol=1e-5, rtol=0)
    assert (got_p1 - got)[valid].abs().max() > 1e-3


def _coupled_brute(model, resp: torch.Tensor, valid: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each token scored with its own pass's tokens masked and the other pass's visible, blocks apart."""
    want = torch.zeros(resp.shape)
    for g, b in itertools.product(range(resp.shape[0]), range(resp.shape[1] // BS)):
        blk = slice(b * BS, (b + 1) * BS)
        for m in (mask[g, blk], ~mask[g, blk]):
            state = torch.where(m, torch.full((BS,), MASK), resp[g, blk])
            lp = _brute(model, PROMPT, torch.cat([resp[g, : b * BS], state]), resp[g, : (b + 1) * BS])[-BS:]
            want[g, blk] = torch.where(m & valid[g, blk], lp, want[g, blk])
    return want


def test_coupled_with_a_fixed_mask_equals_brute_force():
    model = _model()
    resp, step = _trace(3, 2, seed=3)
    valid = torch.ones_like(resp, dtype=torch.bool)
    valid[2, BS:] = False
    mask = torch.tensor([[True, False, True, True], [False, False, True, False], [True, True, False, True]])
    got = coupled_logprobs(model, PROMPT, resp, valid, BS, MASK, mask)
    torch.testing.assert_close(got, _coupled_brute(model, resp, valid, mask), atol=1e-5, rtol=0)
    assert (got[~valid] == 0).all() and (got[valid] < 0).all()  # every token scored exactly once
    # the seeded entry point draws coupled_mask(seed): reproducible, and seeds differ
    by_seed = response_logprobs("coupled", model, PROMPT, resp, step, valid, BS, MASK, seed=7)
    again = response_logprobs("coupled", model, PROMPT, resp, step, valid, BS, MASK, seed=7)
    torch.testing.assert_close(by_seed, again, atol=0, rtol=0)
    fixed = coupled_logprobs(model, PROMPT, resp, valid, BS, MASK, coupled_mask(tuple(resp.shape), 7))
    torch.testing.assert_close(by_seed, fixed, atol=0, rtol=0)
    assert not torch.equal(coupled_mask((3, 4), 7), coupled_mask((3, 4), 8))


def test_coupled_is_unbiased_for_the_expectation_over_all_masks():
    """Per-token mean over 200 seeds within 3 standard errors of the exact expectation (all 16 masks)."""
    model = _model()
    resp = torch.tensor([[2, 4, 1, 3]])
    n_seeds = 200
    expect, draws = coupled_expectation_and_draws(model, PROMPT, resp, BS, MASK, seeds=n_seeds)
    mean, se = draws.mean(0), draws.std(0) / math.sqrt(n_seeds)
    assert (se > 1e-4).all(), "the estimator should vary with the mask on this model"
    assert ((mean - expect).abs() <= 3 * se).all(), f"mean {mean} vs expectation {expect} (se {se})"


@pytest.mark.parametrize("estimator", ["tracerl", "coupled", "diffu_grpo"])
def test_learner_train_step_runs_one_update_with_each_estimator(estimator):
    model = _model()
    learner = object.__new__(Learner.__ray_actor_class__)  # the actor's class, without Ray or DeepSpeed
    learner.cfg = DiceConfig(rl=RLConfig(logprob_estimator=estimator, seed=3))
    learner.policy = SimpleNamespace(block_size=BS, mask_id=MASK)
    learner.device, learner.engine, learner.ref_model, learner.step_count = torch.device("cpu"), PlainEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2)), None, 0
    groups = []
    for k in range(2):
        resp, step = _trace(3, 2, seed=10 + k)
        mask = torch.ones_like(resp, dtype=torch.bool)
        blp = tracerl_logprobs(model, PROMPT, resp, step, mask, BS, MASK).detach()  # what the sampler records
        groups.append(TrainGroup(PROMPT, resp, step, mask, blp, torch.tensor([1.0, -1.0, 0.5])))
    before = [p.detach().clone() for p in model.parameters()]
    out = learner.train_step(groups)
    # old log-probs came from the same estimator, masks and weights: the first (only) epoch's ratio is 1
    assert out["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and out["clip_fraction"] == 0.0
    assert out["tokens"] == 24 and out["step"] == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert estimator_seed(3, 0, 1) != estimator_seed(3, 0, 0) != estimator_seed(3, 1, 0)


def test_unknown_estimator_and_bad_input_are_refused():
    model = _model()
    resp, step = _trace(1, 2, seed=0)
    ok = torch.ones_like(resp, dtype=torch.bool)
    with pytest.raises(ValueError, match="estimator"):
        response_logprobs("llada_mc", model, PROMPT, resp, step, ok, BS, MASK)
    with pytest.raises(ValueError, match="mask"):
        coupled_logprobs(model, PROMPT, resp, ok, BS, MASK, ok[:, :2])
    with pytest.raises(ValueError, match="multiple of block_size"):
        response_logprobs("diffu_grpo", model, PROMPT, resp[:, :3], step[:, :3], ok[:, :3], BS, MASK)
    with pytest.raises(ValueError, match="p_mask_prompt"):
        diffu_grpo_logprobs(model, PROMPT, resp, ok, BS, MASK, p_mask_prompt=1.5)
