"""RL and SFT of the bidirectional families (LLaDA, Dream) on infilling in place: the span is decoded between a fixed
prefix and suffix and grows a block at a time; the learner's log-probs see the same context (suffix, span length at
every step); SDAR keeps the scaffold in its prompt and refuses a suffix; rollout workers and eval pose a task through
one entry point (``sample_task_group``)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from dice_ray.cluster.learner import Learner, make_train_group
from dice_ray.config import DiceConfig, ModelConfig, RLConfig, SamplingConfig, SFTConfig
from dice_ray.policy.families import logit_shift
from dice_ray.policy.logprobs import ESTIMATORS, response_logprobs
from dice_ray.policy.model import forward_hidden, token_logits
from dice_ray.policy.policy import DiffusionPolicy
from dice_ray.policy.sampler import infill_group
from dice_ray.policy.sft_batches import tokenize_pairs
from dice_ray.policy.sft_loss import diffusion_loss, masked_diffusion_loss
from dice_ray.policy.sft_run import SFTRun
from dice_ray.policy.task_sampling import sample_task_group
from dice_ray.tasks.loaders import load_tasks
from dice_ray.tasks.prompts import assemble_candidate, build_prompt, infill_context, sft_pairs

from _helpers import TINY_FAMILY_SHAPE, PlainEngine

TASK = load_tasks("builtin").tasks[0]  # relu, with a fast-format solution to cut
FAMILIES = ["llada", "dream"]
MAX_NEW = 16  # the span grows 4 -> 8 -> 12 -> 16 (block_size 4)
REMASKING = {  # static: 2 tokens a step; dynamic: every draw above a threshold the random model's draws straddle
    "static": SamplingConfig(max_new_tokens=MAX_NEW, temperature=1.0, remasking="static", steps_per_block=2),
    "dynamic": SamplingConfig(max_new_tokens=MAX_NEW, temperature=1.0, remasking="dynamic", threshold=2.5e-4),
}


def _policy(family: str) -> DiffusionPolicy:
    """A tiny random policy whose eos logit is raised by 5 (a forward hook, so the sampler and the replay see the
    same model): spans end at random places, some after growing, some with positions decoded after their eos."""
    pol = DiffusionPolicy.build(ModelConfig(family=family, **TINY_FAMILY_SHAPE), seed=1)
    bias = torch.zeros(pol.tokenizer.vocab_size)
    bias[pol.eos_id] = 5.0
    pol.model.lm_head.register_forward_hook(lambda module, inputs, out: out + bias.to(out.dtype))
    return pol


def _infill_group(pol: DiffusionPolicy, remasking: str, n: int = 8):
    before, after = infill_context(TASK)
    return infill_group(pol, before, after, n, REMASKING[remasking], seed=2)


def _train_group(pol: DiffusionPolicy, remasking: str = "static", n: int = 8, advantages: list[float] | None = None):
    group = _infill_group(pol, remasking, n)
    adv = torch.tensor(advantages) if advantages is not None else torch.zeros(n)
    return group, make_train_group(group[0].prompt_ids, list(group), adv)


def _tracerl(pol, g, **context):
    return response_logprobs("tracerl", pol.model, g.prompt_ids, g.response_ids, g.unmask_step, g.mask, pol.block_size,
                             pol.mask_id, **context)


@pytest.mark.parametrize("remasking", ["static", "dynamic"])
@pytest.mark.parametrize("family", FAMILIES)
def test_tracerl_replays_a_grown_infill_span_with_its_suffix_and_trace(family, remasking):
    pol = _policy(family)
    group, g = _train_group(pol, remasking)
    before, after = infill_context(TASK)
    for r in group:
        assert r.prompt_ids == pol.encode(before) and r.suffix_ids == pol.encode(after)
        assert max(r.unmask_step + r.tail_steps) < len(r.span_lengths)  # a length for every step it took
        assert r.span_lengths[0] == pol.block_size and r.span_lengths == sorted(r.span_lengths)
        assert all(b - a in (0, pol.block_size) for a, b in zip(r.span_lengths, r.span_lengths[1:]))
        assert len(r.response_ids) + len(r.tail_ids) <= r.span_lengths[-1] <= MAX_NEW
    # the cases under test happened: spans grew, positions after an eos were decoded before it (a tail), others
    # stayed masked to the end; steps unmasked several tokens (static: 2 a step; dynamic: all above the threshold)
    assert any(len(set(r.span_lengths)) > 1 for r in group)
    assert any(s >= 0 for r in group for s in r.tail_steps)
    assert any(r.finished and r.span_lengths[-1] > len(r.response_ids) + len(r.tail_ids) for r in group)
    assert any(len(set(r.unmask_step)) < len(r.unmask_step) for r in group)
    with torch.no_grad():
        got = _tracerl(pol, g, suffix_ids=g.suffix_ids, span_lens=g.span_lens)
        no_suffix = _tracerl(pol, g, span_lens=g.span_lens)
        no_trace = _tracerl(pol, g, suffix_ids=g.suffix_ids, canvas_len=MAX_NEW)
    assert (got - g.behaviour_logprobs)[g.mask].abs().max() <= 1e-5
    assert (got[~g.mask] == 0).all()
    assert (no_suffix - got)[g.mask].abs().max() > 1e-3  # the suffix is part of every state
    assert (no_trace - got)[g.mask].abs().max() > 1e-3  # and so is the span's length at each step


@pytest.mark.parametrize("estimator", ["coupled", "diffu_grpo"])
@pytest.mark.parametrize("family", FAMILIES)
def test_coupled_and_diffu_grpo_score_an_infill_group_with_its_suffix(family, estimator):
    pol = _policy(family)
    _, g = _train_group(pol, n=4)
    args = (estimator, pol.model, g.prompt_ids, g.response_ids, g.unmask_step, g.mask, pol.block_size, pol.mask_id)
    longest = int(g.span_lens.max())
    lp = response_logprobs(*args, seed=7, canvas_len=longest, suffix_ids=g.suffix_ids)
    assert torch.isfinite(lp).all() and (lp[g.mask] < 0).all() and (lp[~g.mask] == 0).all()
    lp[g.mask].sum().backward()
    grads = [p.grad for p in pol.model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(x).all() for x in grads) and sum(x.abs().sum() for x in grads) > 0
    with torch.no_grad():
        without = response_logprobs(*args, seed=7, canvas_len=longest)
    assert (without - lp.detach())[g.mask].abs().max() > 1e-3  # the suffix is attended


def test_sdar_refuses_a_suffix_and_a_span_trace():
    pol = DiffusionPolicy.build(ModelConfig(family="sdar", **TINY_FAMILY_SHAPE), seed=1)
    resp = torch.randint(3, 50, (2, 8))
    step = torch.arange(8).remainder(4).expand(2, -1).contiguous()
    ok = torch.ones(2, 8, dtype=torch.bool)
    args = (pol.model, torch.tensor([5, 6, 7]), resp, step, ok, pol.block_size, pol.mask_id)
    for estimator in ESTIMATORS:
        response_logprobs(estimator, *args, suffix_ids=torch.zeros(0, dtype=torch.long))  # empty: today's behaviour
        with pytest.raises(ValueError, match="suffix_ids: must be empty for SDAR, which keeps the scaffold in its prompt"):
            response_logprobs(estimator, *args, suffix_ids=torch.tensor([9, 10]))
    with pytest.raises(ValueError, match="span_lens: SDAR decodes fixed blocks"):
        response_logprobs("tracerl", *args, span_lens=torch.full((2, 4), 8))


def test_bad_span_traces_are_refused():
    pol = _policy("llada")
    _, g = _train_group(pol, n=3)
    with pytest.raises(ValueError, match=r"span_lens: must be \[G=3, N\]"):
        _tracerl(pol, g, suffix_ids=g.suffix_ids, span_lens=g.span_lens[:, :1])
    with pytest.raises(ValueError, match="span_lens: a state's span"):
        _tracerl(pol, g, suffix_ids=g.suffix_ids, span_lens=torch.ones_like(g.span_lens))
    with pytest.raises(ValueError, match="suffix_ids: must be a 1-D"):
        _tracerl(pol, g, suffix_ids=g.suffix_ids[None], span_lens=g.span_lens)
    rollouts = list(_infill_group(pol, "static", 2))
    rollouts[1].suffix_ids = rollouts[1].suffix_ids[:-1]
    with pytest.raises(ValueError, match="share one suffix_ids"):
        make_train_group(rollouts[0].prompt_ids, rollouts, torch.zeros(2))


@pytest.mark.parametrize("family,estimator", [("llada", "tracerl"), ("dream", "tracerl"), ("llada", "coupled"),
                                              ("dream", "diffu_grpo")])
def test_learner_train_step_on_an_infill_group(family, estimator):
    """The learner's step (without Ray or DeepSpeed) on infill groups: finite loss, gradients, an update; TraceRL's
    ratio is 1 (the replay of suffix and trace gives the behaviour log-probs), the others' too (same weights)."""
    pol = _policy(family)
    learner = object.__new__(Learner.__ray_actor_class__)
    learner.cfg = DiceConfig(rl=RLConfig(logprob_estimator=estimator, seed=3),
                             sampling=SamplingConfig(max_new_tokens=MAX_NEW))
    learner.policy = SimpleNamespace(block_size=pol.block_size, mask_id=pol.mask_id)
    learner.device, learner.engine, learner.ref_model, learner.step_count = (
        torch.device("cpu"), PlainEngine(pol.model, torch.optim.AdamW(pol.model.parameters(), lr=1e-3)), None, 0)
    group, train = _train_group(pol, n=4, advantages=[1.0, -1.0, 0.5, 0.25])
    assert train.suffix_ids.tolist() == group[0].suffix_ids and train.span_lens.shape[0] == 4
    before = [p.detach().clone() for p in pol.model.parameters()]
    out = learner.train_step([train])
    assert math.isfinite(out["loss"]) and out["loss"] != 0.0
    assert out["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and out["clip_fraction"] == 0.0
    assert all(torch.isfinite(p).all() for p in pol.model.parameters())  # finite gradients made a finite update
    assert any(not torch.equal(a, b) for a, b in zip(before, pol.model.parameters()))


@pytest.mark.parametrize("family", ["sdar", "llada"])
def test_sample_task_group_poses_infill_by_family_and_builds_the_candidates(family):
    pol = DiffusionPolicy.build(ModelConfig(family=family, **TINY_FAMILY_SHAPE), seed=1)
    cfg = SamplingConfig(max_new_tokens=8, temperature=1.0, remasking="static")
    group, sources = sample_task_group(pol, TASK, "infill", "compact", "source", 2, cfg, seed=5)
    assert len(group) == len(sources) == 2
    assert sources == [assemble_candidate(TASK, "infill", r.text, "source") for r in group]
    if family == "sdar":  # the scaffold in the prompt, nothing after the response
        assert all(r.prompt_ids == pol.encode(build_prompt(TASK, "infill")) and not r.suffix_ids for r in group)
    else:  # the middle in place between the scaffold's two sides
        before, after = infill_context(TASK)
        assert all(r.prompt_ids == pol.encode(before) and r.suffix_ids == pol.encode(after) for r in group)
    again, same = sample_task_group(pol, TASK, "infill", "compact", "source", 2, cfg, seed=5)
    assert same == sources and [r.response_ids for r in again] == [r.response_ids for r in group]
    e2e, e2e_sources = sample_task_group(pol, TASK, "e2e", "compact", "source", 1, cfg, seed=5)
    assert e2e[0].prompt_ids == pol.encode(build_prompt(TASK, "e2e")) and not e2e[0].suffix_ids
    assert e2e_sources == [assemble_candidate(TASK, "e2e", e2e[0].text)]


@pytest.mark.parametrize("family", FAMILIES)
def test_sft_loss_of_an_infill_triple_reads_the_after_clean_and_scores_the_masked_middle(family):
    pol = DiffusionPolicy.build(ModelConfig(family=family, **dict(TINY_FAMILY_SHAPE, num_hidden_layers=1)), seed=0)
    pol.model.eval()
    (p, r, s), = tokenize_pairs(pol, [("Reference: relu\nsource = '''\n", "y[i] = fmaxf(x[i], 0.f);\n", "'''\n")])
    mask = torch.tensor([j % 2 == 0 for j in range(len(r))])
    t = 0.4
    got = masked_diffusion_loss(pol, [(p, r, s)], [mask], torch.tensor([t]))
    seq = torch.cat([torch.tensor(p), torch.where(mask, pol.mask_id, torch.tensor(r)), torch.tensor(s)])
    n = seq.numel()
    with torch.no_grad():
        logits = token_logits(pol.model, forward_hidden(pol.model, seq[None], torch.arange(n),
                                                        torch.ones(n, n, dtype=torch.bool))[0], pol.mask_id)
    at = len(p) + torch.nonzero(mask).squeeze(1) - logit_shift(family)
    expected = F.cross_entropy(logits[at], torch.tensor(r)[mask], reduction="sum").item() / t / len(r)
    assert got.item() == pytest.approx(expected, rel=1e-5)
    without_after = masked_diffusion_loss(pol, [(p, r)], [mask], torch.tensor([t]))
    assert abs(without_after.item() - got.item()) > 1e-4  # the after text is attended


@pytest.mark.parametrize("family", FAMILIES)
def test_sft_on_infill_triples_decreases_their_loss(family):
    pol = DiffusionPolicy.build(ModelConfig(family=family, **TINY_FAMILY_SHAPE), seed=0)
    pairs = sft_pairs(TASK, "compact", family)
    assert sorted(len(x) for x in pairs)[-1] == 3 and any(len(x) == 2 for x in pairs)  # infill triples, e2e pairs
    triples = [x for x in pairs if len(x) == 3]
    items = tokenize_pairs(pol, triples)

    def loss() -> float:
        with torch.no_grad():
            return diffusion_loss(pol, items, torch.Generator().manual_seed(0))[0].item()

    start = loss()
    cfg = SFTConfig(steps=30, batch_size=2, learning_rate=1e-2, warmup_steps=2, target_loss=None, log_every=10)
    run = SFTRun(pol, pairs, cfg, seed=0)  # mixed batches: triples and end-to-end pairs
    while not run.finished:
        run.train_step()
    assert loss() < 0.7 * start, (start, loss())


def test_sft_refuses_triples_for_sdar_and_bad_pair_shapes():
    sdar = DiffusionPolicy.build(ModelConfig(family="sdar", **TINY_FAMILY_SHAPE), seed=0)
    with pytest.raises(ValueError, match=r"pairs\[0\]: a \(before, middle, after\) triple infills in place"):
        tokenize_pairs(sdar, [("a = ", "1", "\n")])
    with pytest.raises(ValueError, match="items: SDAR trains"):
        diffusion_loss(sdar, [([5], [6, 7, 8, 2], [9])], torch.Generator())
    with pytest.raises(ValueError, match=r"pairs\[1\]: must be \(prompt, target\)"):
        tokenize_pairs(_policy("llada"), [("a", "b"), ("a",)])
