"""Block-diffusion sampling: traces, remasking schedules, determinism, token drawing."""

from __future__ import annotations

import pytest
import torch

from dice_ray.config import ModelConfig, SamplingConfig
from dice_ray.policy.policy import DiffusionPolicy
from dice_ray.policy.sampler import SampleStats, draw_tokens, sample_group, transfer_schedule

TINY = ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, max_position_embeddings=512, block_size=4)
PROMPT = "Reference:\nimport torch\nclass Model(nn.Module):\n    pass\n"


@pytest.fixture(scope="module")
def policy():
    return DiffusionPolicy.build(TINY, seed=0)


def test_transfer_schedule():
    assert transfer_schedule(4, 4) == [1, 1, 1, 1]
    assert transfer_schedule(4, 2) == [2, 2]
    assert transfer_schedule(5, 2) == [3, 2]
    assert transfer_schedule(4, 9) == [1, 1, 1, 1]


def _per_block_counts(r, bs):
    out = []
    for b in range(0, len(r.unmask_step), bs):
        steps = r.unmask_step[b : b + bs]
        out.append([steps.count(s) for s in range(max(steps) + 1)])
    return out


def test_static_remasking_trace(policy):
    cfg = SamplingConfig(max_new_tokens=24, remasking="static", steps_per_block=2)
    group = sample_group(policy, PROMPT, 3, cfg, seed=0)
    assert len(group) == 3
    for r in group:
        assert len(r.response_ids) == 24 and len(r.unmask_step) == 24 and len(r.behaviour_logprobs) == 24
        assert policy.mask_id not in r.response_ids
        assert all(c == [2, 2] for c in _per_block_counts(r, 4))  # k = 4 / 2 tokens a step
        assert all(lp <= 0 for lp in r.behaviour_logprobs)
        assert r.prompt_ids == policy.encode(PROMPT)


def test_dynamic_remasking_trace(policy):
    cfg = SamplingConfig(max_new_tokens=24, remasking="dynamic", threshold=0.9)
    group = sample_group(policy, PROMPT, 2, cfg, seed=0)
    for r in group:
        for counts in _per_block_counts(r, 4):
            assert sum(counts) == 4 and min(counts) >= 1  # at least one token a step, steps contiguous
    # a threshold every draw passes unmasks whole blocks in one step
    easy = sample_group(policy, PROMPT, 2, cfg.model_copy(update={"threshold": 1e-9}), seed=0)
    assert all(s == 0 for r in easy for s in r.unmask_step)
    assert isinstance(group.stats, SampleStats)
    assert group.stats.new_tokens == 48 and group.stats.tokens_per_s > 0


def test_sampling_is_seeded(policy):
    cfg = SamplingConfig(max_new_tokens=16, temperature=1.0)
    a = sample_group(policy, PROMPT, 3, cfg, seed=11)
    b = sample_group(policy, PROMPT, 3, cfg, seed=11)
    c = sample_group(policy, PROMPT, 3, cfg, seed=12)
    assert [r.response_ids for r in a] == [r.response_ids for r in b]
    assert [r.response_ids for r in a] != [r.response_ids for r in c]
    assert len({tuple(r.response_ids) for r in a}) > 1  # samples of a group differ at temperature 1


def test_greedy_group_is_identical(policy):
    group = sample_group(policy, PROMPT, 3, SamplingConfig(max_new_tokens=16, temperature=0.0), seed=0)
    assert len({tuple(r.response_ids) for r in group}) == 1


def test_sampler_rejects_bad_input(policy):
    with pytest.raises(ValueError, match="num_samples"):
        sample_group(policy, PROMPT, 0, SamplingConfig(max_new_tokens=8), seed=0)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        sample_group(policy, PROMPT, 1, SamplingConfig(max_new_tokens=1024), seed=0)
    with pytest.raises(ValueError, match="prompt_ids"):
        sample_group(policy, "", 1, SamplingConfig(max_new_tokens=8), seed=0)


def test_draw_tokens_filters_and_frequencies():
    gen = torch.Generator().manual_seed(0)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    tok, conf = draw_tokens(logits, 0.0, None, None, gen)
    assert tok.item() == 0 and conf.item() == pytest.approx(0.5)
    many = logits.expand(20000, 4)
    tok, conf = draw_tokens(many, 1.0, None, None, gen)
    freq = torch.bincount(tok, minlength=4).float() / 20000
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.015, rtol=0)
    torch.testing.assert_close(conf, torch.tensor([0.5, 0.3, 0.15, 0.05])[tok])
    tok, conf = draw_tokens(many, 1.0, 2, None, gen)  # top-k 2: renormalised over {0, 1}
    assert set(tok.tolist()) == {0, 1}
    assert conf[tok == 0][0].item() == pytest.approx(0.5 / 0.8)
    tok, _ = draw_tokens(many, 1.0, None, 0.7, gen)  # top-p 0.7 keeps {0, 1} (0.5 < 0.7 <= 0.8)
    assert set(tok.tolist()) == {0, 1}
    tok, _ = draw_tokens(many, 1.0, None, 0.4, gen)
    assert set(tok.tolist()) == {0}
