"""Masked-diffusion SFT warm start: loss layout, memorization, content-hash cache."""

from __future__ import annotations

import time

import pytest
import torch

from dice_ray.config import ModelConfig, SamplingConfig, SFTConfig
from dice_ray.policy.policy import DiffusionPolicy
from dice_ray.policy.sampler import sample_group
from dice_ray.policy.sft import diffusion_loss, sft_cache_key, tokenize_pairs, warm_start

TINY = ModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=512, block_size=4)
PAIRS = [
    ("Reference: relu\nCUDA source:\n", 'extern "C" __global__ void relu(float* y) { y[0] = 0.f; }\n'),
    ("Reference: tanh\nCUDA source:\n", 'extern "C" __global__ void tanh_k(float* y) { y[0] = tanhf(y[0]); }\n'),
]


def test_tokenize_pairs_pads_targets_with_eos():
    policy = DiffusionPolicy.build(TINY)
    items = tokenize_pairs(policy, PAIRS)
    for (p, t), (prompt, target) in zip(items, PAIRS):
        assert p == policy.encode(prompt)
        n = len(policy.encode(target))
        assert len(t) % 4 == 0 and t[:n] == policy.encode(target) and set(t[n:]) == {policy.eos_id}
    with pytest.raises(ValueError, match=r"pairs\[0\]: the prompt is empty"):
        tokenize_pairs(policy, [("", "x")])


def test_complementary_masks_cover_every_target_token():
    policy = DiffusionPolicy.build(TINY)
    items = tokenize_pairs(policy, PAIRS)
    gen = torch.Generator().manual_seed(0)
    loss, n = diffusion_loss(policy, items, gen, complementary=True)
    assert n == sum(len(t) for _, t in items)  # each response token a target exactly once
    assert torch.isfinite(loss) and loss.item() > 0
    _, n1 = diffusion_loss(policy, items, gen, complementary=False)
    assert len(items) <= n1 < n  # >= 1 masked token a block, not all


def test_warm_start_memorizes_and_caches(tmp_path):
    cfg = SFTConfig(steps=120, batch_size=2, learning_rate=1e-2, warmup_steps=5, target_loss=None,
                    cache_dir=str(tmp_path))
    policy = DiffusionPolicy.build(TINY, seed=0)
    report = warm_start(policy, PAIRS, cfg, seed=0)
    assert not report.cache_hit and report.steps == 120 and report.num_pairs == 2
    assert report.losses[0][1] > 1.0 and report.final_loss < 0.05
    greedy = SamplingConfig(max_new_tokens=64, temperature=0.0)
    for prompt, target in PAIRS:
        (r,) = sample_group(policy, prompt, 1, greedy, seed=0)
        assert r.text == target and r.finished
        assert len(r.response_ids) < 64  # stopped after the block holding <|eos|>

    again = DiffusionPolicy.build(TINY, seed=0)
    t0 = time.perf_counter()
    hit = warm_start(again, PAIRS, cfg, seed=0)
    assert hit.cache_hit and hit.steps == 0 and time.perf_counter() - t0 < 2.0
    assert hit.cache_key == report.cache_key and hit.final_loss == report.final_loss
    for k, v in policy.state_dict().items():
        assert torch.equal(v, again.state_dict()[k])

    fresh = DiffusionPolicy.build(TINY, seed=0)
    keys = {
        sft_cache_key(fresh, PAIRS, cfg, 0),
        sft_cache_key(fresh, PAIRS, cfg, 1),
        sft_cache_key(fresh, PAIRS[:1], cfg, 0),
        sft_cache_key(fresh, PAIRS, cfg.model_copy(update={"learning_rate": 5e-3}), 0),
        sft_cache_key(DiffusionPolicy.build(TINY, seed=1), PAIRS, cfg, 0),
    }
    assert len(keys) == 5  # seed, pairs, SFT config and initial weights all change the key
    assert sft_cache_key(fresh, PAIRS, cfg.model_copy(update={"cache_dir": "/elsewhere"}), 0) == report.cache_key


def test_target_loss_stops_early(tmp_path):
    cfg = SFTConfig(steps=400, batch_size=2, learning_rate=1e-2, warmup_steps=5, target_loss=1.0,
                    cache_dir=str(tmp_path))
    report = warm_start(DiffusionPolicy.build(TINY), PAIRS, cfg, seed=0)
    assert 20 < report.steps < 400 and report.losses[-1][0] == report.steps


def test_warm_start_disabled_and_empty(tmp_path):
    policy = DiffusionPolicy.build(TINY)
    before = policy.state_dict()["model.embed_tokens.weight"].clone()
    r = warm_start(policy, PAIRS, SFTConfig(enabled=False, cache_dir=str(tmp_path)), seed=0)
    assert r.steps == 0 and not r.cache_hit
    assert torch.equal(policy.state_dict()["model.embed_tokens.weight"], before)
    with pytest.raises(ValueError, match="pairs"):
        warm_start(policy, [], SFTConfig(cache_dir=str(tmp_path)), seed=0)
