"""The three RL log-prob estimators on the bidirectional families (LLaDA, Dream) against brute force.

Brute force: for each state an estimator claims to score a token in, one plain full-attention forward of the
concrete sequence ``prompt ‖ state ‖ <|mask|> * (canvas - R)`` (no batching across states), the token read at
position ``P + i - shift`` with the shift written here by hand (LLaDA 0, Dream 1; not taken from the code under
test) and its probability normalised by hand in float64 over the vocabulary (the mask token excluded).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from dice_ray.cluster.learner import Learner, TrainGroup
from dice_ray.config import DiceConfig, ModelConfig, RLConfig, SamplingConfig
from dice_ray.policy import sampler
from dice_ray.policy.families import build_model
from dice_ray.policy.logprobs import (
    coupled_logprobs,
    coupled_mask,
    diffu_grpo_logprobs,
    response_logprobs,
    tracerl_logprobs,
)
from dice_ray.policy.model import forward_hidden
from dice_ray.policy.policy import DiffusionPolicy
from _helpers import TINY_FAMILY_SHAPE, PlainEngine, coupled_expectation_and_draws

V, MASK, BS = 6, 5, 2  # tokens 0..4 (0 = pad), 5 = <|mask|>; block_size is unused by these families
SHIFT = {"llada": 0, "dream": 1}
FAMILIES = ["llada", "dream"]
PROMPT = torch.tensor([3, 1, 4, 2])


def _model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    cfg = ModelConfig(family=family, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, max_position_embeddings=128, block_size=BS)
    model = build_model(cfg, V, 0).eval()
    with torch.no_grad():  # sharpen the random model so the conditioning state changes log-probs visibly
        model.model.norm.weight.mul_(20.0)
    return model


def _brute(model, shift: int, prompt: torch.Tensor, state: torch.Tensor, targets: torch.Tensor,
           canvas: int | None = None) -> torch.Tensor:
    """log p(targets[i] | prompt ‖ state ‖ masks up to ``canvas``) at response position i, one forward."""
    P, R = prompt.numel(), targets.numel()
    seq = torch.cat([prompt, state, torch.full(((canvas or R) - R,), MASK)])
    T = seq.numel()
    with torch.no_grad():
        h = forward_hidden(model, seq[None], torch.arange(T), torch.ones(T, T, dtype=torch.bool))[0]
        logits = model.lm_head(h[P - shift: P - shift + R]).double()
    w = (logits - logits.max(-1, keepdim=True).values).exp()
    w[:, MASK] = 0.0
    return (w.gather(-1, targets[:, None])[:, 0] / w.sum(-1)).log().float()


def _trace(G: int, R: int, seed: int):
    """Random responses and whole-response traces: a random order cut into steps of 1-3 tokens."""
    gen = torch.Generator().manual_seed(seed)
    resp = torch.randint(1, MASK, (G, R), generator=gen)
    step = torch.zeros(G, R, dtype=torch.long)
    for g in range(G):
        order, s, i = torch.randperm(R, generator=gen), 0, 0
        while i < R:
            k = int(torch.randint(1, 4, (), generator=gen))
            step[g, order[i: i + k]] = s
            i, s = i + k, s + 1
    return resp, step


@pytest.mark.parametrize("family", FAMILIES)
def test_tracerl_equals_a_manual_replay_of_the_trace(family):
    model, shift = _model(family), SHIFT[family]
    G, R, C = 3, 5, 7  # R not a multiple of block_size; the sampler decoded a canvas of 7
    resp, step = _trace(G, R, seed=1)
    valid = torch.ones(G, R, dtype=torch.bool)
    valid[2, 2:] = False  # row 2's response ended at 2; position 2 is its tail (decoded at step 0 before
    resp[2, 4], step[2, 3:] = 0, -1  # the eos), 3 was never decoded, 4 is padding (the learner: id 0, step -1)
    step[2, 2] = 0
    got = tracerl_logprobs(model, PROMPT, resp, step, valid, BS, MASK, canvas_len=C)
    want = torch.zeros_like(got)
    for g in range(G):
        for s in step[g][valid[g]].unique().tolist():  # the sampler's state before step s
            state = torch.where((valid[g] | (step[g] >= 0)) & (step[g] < s), resp[g], torch.full((R,), MASK))
            lp = _brute(model, shift, PROMPT, state, resp[g], C)
            want[g] = torch.where(valid[g] & (step[g] == s), lp, want[g])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (got[~valid] == 0).all() and (got[valid] < 0).all()
    # the tail is part of the states after its step: hiding it moves row 2's values
    untailed = step.clone()
    untailed[2, 2] = -1
    hidden = tracerl_logprobs(model, PROMPT, resp, untailed, valid, BS, MASK, canvas_len=C)
    assert (hidden - got)[2][valid[2] & (step[2] > 0)].abs().max() > 1e-4
    # the test can fail: the state matters (all tokens scored fully masked give other values) ...
    blind = tracerl_logprobs(model, PROMPT, resp, torch.zeros_like(step), valid, BS, MASK, canvas_len=C)
    assert (blind - got)[valid & (step > 0)].abs().max() > 1e-3
    # ... and so does the canvas: without the 2 trailing masks the values move
    short = tracerl_logprobs(model, PROMPT, resp, step, valid, BS, MASK)
    assert (short - got)[valid].abs().max() > 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_diffu_grpo_equals_brute_force_with_the_canvas_fully_masked(family):
    model, shift = _model(family), SHIFT[family]
    resp, step = _trace(3, 5, seed=2)
    valid = torch.ones_like(resp, dtype=torch.bool)
    valid[1, -1] = False
    got = response_logprobs("diffu_grpo", model, PROMPT, resp, step, valid, BS, MASK, seed=123, canvas_len=6)
    all_masked = torch.full((5,), MASK)
    want = torch.stack([_brute(model, shift, PROMPT, all_masked, r, 6) for r in resp]) * valid
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    got_p1 = diffu_grpo_logprobs(model, PROMPT, resp, valid, BS, MASK, p_mask_prompt=1.0, canvas_len=6)
    want_p1 = torch.stack([_brute(model, shift, torch.full_like(PROMPT, MASK), all_masked, r, 6) for r in resp])
    torch.testing.assert_close(got_p1, want_p1 * valid, atol=1e-5, rtol=0)
    assert (got_p1 - got)[valid].abs().max() > 1e-3


def _coupled_brute(model, shift: int, resp: torch.Tensor, valid: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each token scored with its own part masked and the other part of the whole response visible."""
    want = torch.zeros(resp.shape)
    for g in range(resp.shape[0]):
        for m in (mask[g], ~mask[g]):
            state = torch.where(valid[g] & ~m, resp[g], torch.full_like(resp[g], MASK))
            want[g] = torch.where(m & valid[g], _brute(model, shift, PROMPT, state, resp[g]), want[g])
    return want


@pytest.mark.parametrize("family", FAMILIES)
def test_coupled_with_a_fixed_mask_equals_brute_force(family):
    model, shift = _model(family), SHIFT[family]
    resp, _ = _trace(3, 5, seed=3)
    valid = torch.ones_like(resp, dtype=torch.bool)
    valid[2, 3:] = False
    mask = torch.tensor([[True, False, True, True, False], [False, False, True, False, True],
                         [True, True, False, True, True]])
    got = coupled_logprobs(model, PROMPT, resp, valid, BS, MASK, mask)
    torch.testing.assert_close(got, _coupled_brute(model, shift, resp, valid, mask), atol=1e-5, rtol=0)
    assert (got[~valid] == 0).all() and (got[valid] < 0).all()  # every token scored exactly once


@pytest.mark.parametrize("family", FAMILIES)
def test_coupled_is_unbiased_for_the_expectation_over_all_masks(family):
    """Per-token mean over 200 seeds within 3 standard errors of the exact expectation (all 16 masks)."""
    model = _model(family)
    resp = torch.tensor([[2, 4, 1, 3]])
    n_seeds = 200
    expect, draws = coupled_expectation_and_draws(model, PROMPT, resp, BS, MASK, seeds=n_seeds)
    mean, se = draws.mean(0), draws.std(0) / math.sqrt(n_seeds)
    # the estimator varies with the mask (Dream's first token, read at the last prompt position, only a little)
    assert (se > 1e-6).all() and se.max() > 1e-3, f"se {se}"
    assert ((mean - expect).abs() <= 3 * se).all(), f"mean {mean} vs expectation {expect} (se {se})"


@pytest.mark.parametrize("estimator", ["tracerl", "coupled", "diffu_grpo"])
def test_dream_reads_the_logits_one_position_to_the_left(estimator):
    """Fails if Dream's shift is dropped: the unshifted reading gives other values, the shifted one matches."""
    model = _model("dream")
    resp, step = _trace(2, 4, seed=4)
    valid = torch.ones_like(resp, dtype=torch.bool)
    got = response_logprobs(estimator, model, PROMPT, resp, step, valid, BS, MASK, seed=5)
    if estimator == "tracerl":  # (row, positions masked in the state, positions scored in it)
        states = [(g, step[g] >= s, step[g] == s) for g in range(2) for s in step[g].unique().tolist()]
    elif estimator == "diffu_grpo":
        states = [(g, valid[g], valid[g]) for g in range(2)]
    else:
        m = coupled_mask((2, 4), 5)
        states = [(g, part, part) for g in range(2) for part in (m[g], ~m[g])]
    for shift, close in ((1, True), (0, False)):
        want = torch.zeros_like(got)
        for g, hidden, here in states:
            state = torch.where(hidden, torch.full((4,), MASK), resp[g])
            want[g] = torch.where(here, _brute(model, shift, PROMPT, state, resp[g]), want[g])
        if close:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        else:
            assert (got - want).abs().max() > 1e-2


TINY = TINY_FAMILY_SHAPE


@pytest.mark.parametrize("family", FAMILIES)
def test_tracerl_reproduces_the_samplers_behaviour_logprobs(family, monkeypatch):
    """Replaying the sampler's trace gives the log-probs it recorded (eos forced at span position 4 of 8:
    the response is 5 tokens, the canvas the sampler decoded 8)."""
    pol = DiffusionPolicy.build(ModelConfig(family=family, **TINY), seed=1)
    real = sampler.token_logits

    def eos_at_4(model, hidden, mask_id):
        logits = real(model, hidden, mask_id)
        logits[..., 4, pol.eos_id] += 40.0
        return logits

    monkeypatch.setattr(sampler, "token_logits", eos_at_4)
    # one token a step: the eos goes first, so no position after it is ever decoded (the rollout drops those)
    cfg = SamplingConfig(max_new_tokens=8, temperature=1.0, remasking="static", steps_per_block=4)
    prompt = pol.encode("def kernel(x):\n")
    resp, steps, lps, _ = sampler.sample_masked_ids(pol, [prompt] * 3, cfg, torch.Generator().manual_seed(0))
    assert all(len(r) == 5 and r[4] == pol.eos_id and pol.eos_id not in r[:4] for r in resp)
    assert all(s[4] == 0 and sorted(s[:4]) == [1, 2, 3, 4] for s in steps)
    assert len({tuple(r) for r in resp}) > 1 and len({tuple(s) for s in steps}) > 1  # distinct traces
    ids, st = torch.tensor(resp), torch.tensor(steps)
    valid = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        got = tracerl_logprobs(pol.model, torch.tensor(prompt), ids, st, valid, pol.block_size, pol.mask_id,
                               canvas_len=8)
        short = tracerl_logprobs(pol.model, torch.tensor(prompt), ids, st, valid, pol.block_size, pol.mask_id)
    recorded = torch.tensor(lps)
    # the eos position was biased in the sampler only; every other token must match what the sampler recorded
    torch.testing.assert_close(got[:, :4], recorded[:, :4], atol=1e-4, rtol=0)
    assert (short[:, :4] - recorded[:, :4]).abs().max() > 1e-4  # the canvas length is part of the state


@pytest.mark.parametrize("family,estimator", [("llada", "tracerl"), ("llada", "coupled"), ("dream", "diffu_grpo"),
                                              ("dream", "tracerl")])
def test_learner_train_step_runs_one_update_on_a_bidirectional_family(family, estimator):
    model = _model(family)
    learner = object.__new__(Learner.__ray_actor_class__)  # the actor's class, without Ray or DeepSpeed
    # the sampler decoded a canvas of max_new_tokens = 8; the learner replays on it (canvas_len)
    learner.cfg = DiceConfig(rl=RLConfig(logprob_estimator=estimator, seed=3), sampling=SamplingConfig(max_new_tokens=8))
    learner.policy = SimpleNamespace(block_size=BS, mask_id=MASK)
    learner.device, learner.engine, learner.ref_model, learner.step_count = (
        torch.device("cpu"), PlainEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2)), None, 0)
    groups = []
    for k in range(2):
        resp, step = _trace(3, 5, seed=10 + k)  # 5 tokens: not a multiple of block_size
        mask = torch.ones_like(resp, dtype=torch.bool)
        mask[1, 4], resp[1, 4], step[1, 4] = False, 0, 0  # one shorter row, padded as the learner pads
        blp = tracerl_logprobs(model, PROMPT, resp, step, mask, BS, MASK, canvas_len=8).detach()
        groups.append(TrainGroup(PROMPT, resp, step, mask, blp, torch.tensor([1.0, -1.0, 0.5])))
    before = [p.detach().clone() for p in model.parameters()]
    out = learner.train_step(groups)
    # old log-probs: the behaviour replay (tracerl) or the same estimator and masks, same weights: ratio 1
    assert out["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and out["clip_fraction"] == 0.0
    assert out["step"] == 1 and any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_bad_input_is_refused_on_bidirectional_families():
    model = _model("llada")
    resp, step = _trace(1, 3, seed=0)
    ok = torch.ones_like(resp, dtype=torch.bool)
    response_logprobs("tracerl", model, PROMPT, resp, step, ok, BS, MASK)  # R = 3: no block rule here
    with pytest.raises(ValueError, match="canvas_len"):
        response_logprobs("coupled", model, PROMPT, resp, step, ok, BS, MASK, canvas_len=2)
    with pytest.raises(ValueError, match="unmask_step"):
        tracerl_logprobs(model, PROMPT, resp, step - 1, ok, BS, MASK)
    with pytest.raises(ValueError, match="prompt_ids"):
        diffu_grpo_logprobs(model, PROMPT[:0], resp, ok, BS, MASK)


@pytest.mark.parametrize("family", FAMILIES)
def test_tracerl_replays_rollouts_whose_tail_was_decoded_before_their_eos(family, monkeypatch):
    """The sampler decodes by confidence, so a position after the eventual eos can be decoded first. The
    rollout keeps it as its tail (no reward, no loss) and the learner's TraceRL replay shows it in the later
    states: the replayed log-probs equal the sampler's recorded ones; without the tail they do not."""
    from dice_ray.cluster.learner import make_train_group

    pol = DiffusionPolicy.build(ModelConfig(family=family, **TINY), seed=1)
    real = sampler.token_logits

    def eos_likely_at_4(model, hidden, mask_id):
        logits = real(model, hidden, mask_id)
        logits[..., 4, pol.eos_id] += 8.0  # likely, not certain: often drawn after other positions
        return logits

    monkeypatch.setattr(sampler, "token_logits", eos_likely_at_4)
    cfg = SamplingConfig(max_new_tokens=8, temperature=1.0, remasking="static", steps_per_block=4)
    group = sampler.sample_group(pol, "def kernel(x):\n", 8, cfg, seed=3)
    tailed = [r for r in group if any(s >= 0 for s in r.tail_steps)]
    assert tailed, [(r.response_ids, r.unmask_step) for r in group]  # the case under test happened
    for r in group:
        assert len(r.response_ids) + len(r.tail_ids) <= 8 and len(r.tail_ids) == len(r.tail_steps)
        assert not r.tail_ids or r.response_ids[-1] == pol.eos_id  # a tail follows the response's eos
    monkeypatch.setattr(sampler, "token_logits", real)
    train = make_train_group(group[0].prompt_ids, list(group), torch.zeros(len(group)))
    with torch.no_grad():
        got = tracerl_logprobs(pol.model, train.prompt_ids, train.response_ids, train.unmask_step, train.mask,
                               pol.block_size, pol.mask_id, canvas_len=8)
        no_tail = train.unmask_step.clone()
        no_tail[~train.mask] = -1
        blind = tracerl_logprobs(pol.model, train.prompt_ids, train.response_ids, no_tail, train.mask,
                                 pol.block_size, pol.mask_id, canvas_len=8)
    # position 4 was biased in the sampler only; every other scored token must match what the sampler recorded
    scored = train.mask.clone()
    scored[:, 4] = False
    torch.testing.assert_close(got[scored], train.behaviour_logprobs[scored], atol=1e-4, rtol=0)
    rows = [i for i, r in enumerate(group) if r in tailed]
    assert (blind - got)[rows][scored[rows]].abs().max() > 1e-4
