"""SFT on N data-parallel ranks (issue 42 section 3): a rank's shard of each batch, weighted so that the ranks'
mean gradient is the one-rank gradient of the whole batch; ``dice-ray sft`` on 2 gloo ranks writes the weights
1 rank writes."""

from __future__ import annotations

import pytest
import torch

from dice_ray.config import ModelConfig
from dice_ray.policy.policy import DiffusionPolicy
from dice_ray.policy.sft_batches import tokenize_pairs
from dice_ray.policy.sft_loss import diffusion_loss
from _helpers import joined_ray

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, block_size=4)
PAIRS = [
    ("Reference: relu\nCUDA source:\n", 'extern "C" __global__ void relu(float* y) { y[0] = 0.f; }\n'),
    ("Reference: tanh\nCUDA source:\n", 'extern "C" __global__ void tanh_k(float* y) { y[0] = tanhf(y[0]); }\n'),
    ("Reference: add\n", 'extern "C" __global__ void add(float* y, float* x) { y[0] += x[0]; }\n'),
]


def _grads(policy: DiffusionPolicy, loss: torch.Tensor) -> list[torch.Tensor]:
    policy.model.zero_grad(set_to_none=True)
    loss.backward()
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in policy.model.parameters()]


@pytest.mark.parametrize("family", ["sdar", "llada", "dream"])
@pytest.mark.parametrize("world", [2, 4])  # 4 ranks, 3 items: one rank has no item (weight 0)
def test_shard_losses_average_to_the_whole_batch_loss_and_gradient(family, world):
    policy = DiffusionPolicy.build(ModelConfig(family=family, **TINY), seed=0)
    items = tokenize_pairs(policy, PAIRS)
    full, n = diffusion_loss(policy, items, torch.Generator().manual_seed(3), True)
    want = _grads(policy, full)
    losses, grads, counts = [], [], []
    for rank in range(world):
        loss, k = diffusion_loss(policy, items, torch.Generator().manual_seed(3), True, shard=(rank, world))
        losses.append(loss.detach())
        grads.append(_grads(policy, loss))
        counts.append(k)
    assert float(sum(losses) / world) == pytest.approx(float(full), rel=1e-5)
    mean = [sum(g[i] for g in grads) / world for i in range(len(want))]
    scale = max(float(w.abs().max()) for w in want)
    assert scale > 0
    assert max(float((a - b).abs().max()) for a, b in zip(mean, want)) < 1e-5 * scale
    # a dropped shard shows: the first rank's share alone is not the batch's gradient
    assert max(float((g - w).abs().max()) for g, w in zip(grads[0], want)) > 1e-3 * scale
    if family == "sdar":
        assert sum(counts[:3]) == n


# ---- dice-ray sft on 2 gloo ranks (Ray actors) against 1 rank -------------------------------------------------
TINY_CFG = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=1",
            "model.num_attention_heads=2", "model.num_key_value_heads=1", "model.head_dim=16"]
# 6 pairs in batches of 4: a batch of 4 and one of 2 an epoch (a 2-rank shard each time), max_grad_norm large so
# that clipping does not hide a wrong gradient scale
SMALL = [*TINY_CFG, "tasks.max_tasks=3", "sft.batch_size=4", "sft.warmup_steps=1", "sft.learning_rate=1e-2",
         "sft.log_every=1", "sft.num_threads=1", "sft.target_loss=null", "sft.max_grad_norm=1000",
         "sft.steps=3", "sft.checkpoint_every=2"]


@pytest.fixture(scope="module")
def ray_local(ray_head):
    ray = pytest.importorskip("ray")
    with joined_ray(ray_head):
        yield ray


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 2])
def test_sft_on_two_gloo_ranks_writes_the_one_rank_weights(tmp_path, capsys, ray_local, zero):
    import json

    from dice_ray.cli import main

    one, two = tmp_path / "one", tmp_path / "two"
    assert main(["sft", "--out", str(one), "--data", "builtin", *SMALL, "sft.zero_stage=0"]) == 0
    s1 = json.loads(capsys.readouterr().out)
    assert main(["sft", "--out", str(two), "--data", "builtin", *SMALL, f"sft.zero_stage={zero}",
                 "cluster.learner_ranks=2"]) == 0
    s2 = json.loads(capsys.readouterr().out)
    assert s2["ranks"] == 2 and s1["steps"] == s2["steps"] == 3 and "ranks" not in s1
    assert s2["final_loss"] == pytest.approx(s1["final_loss"], rel=1e-5)
    m1, m2 = ([json.loads(x) for x in (d / "sft_metrics.jsonl").read_text().splitlines()] for d in (one, two))
    assert [r["loss"] for r in m2] == pytest.approx([r["loss"] for r in m1], rel=1e-5)
    assert [r["tokens"] for r in m2] == [r["tokens"] for r in m1]
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    p1, p2 = DiffusionPolicy.load(one), DiffusionPolicy.load(two)
    start = DiffusionPolicy.from_config(__import__("dice_ray.config", fromlist=["load_config"]).load_config(None, SMALL).model)
    w0, w1, w2 = start.state_dict(), p1.state_dict(), p2.state_dict()
    assert max(float((w1[k] - w0[k]).abs().max()) for k in w1) > 1e-3, "the steps should move the weights"
    diff = max(float((w1[k] - w2[k]).abs().max()) for k in w1)
    assert diff < 1e-5, f"2 ranks differ from 1 rank by {diff}"


@pytest.mark.slow
def test_warm_start_on_two_learner_ranks_trains_the_one_rank_weights(tmp_path, ray_local):
    from dice_ray.cluster.learner import LearnerGroup, learner_env
    from dice_ray.config import load_config

    ray = ray_local

    def weights(actor):
        return ray.get(actor.__ray_call__.remote(lambda self: {k: v.clone() for k, v in self.policy.model.state_dict().items()}))

    def group(ranks: int, cache: str):
        cfg = load_config(None, [*SMALL, "sft.steps=4", f"sft.cache_dir={tmp_path / cache}", f"cluster.learner_ranks={ranks}"])
        return LearnerGroup(cfg, use_gpu=False, num_threads=1, env=learner_env(False))

    one, two = group(1, "one"), group(2, "two")
    r1, r2 = ray.get([one.warm_start.remote(PAIRS), two.warm_start.remote(PAIRS)])
    assert r1["steps"] == r2["steps"] == 4 and not r1["cache_hit"] and not r2["cache_hit"]
    assert r1["cache_key"] == r2["cache_key"]  # the rank count is no part of the key
    assert r2["final_loss"] == pytest.approx(r1["final_loss"], rel=1e-5)
    w1, w2a, w2b = weights(one.actors[0]), weights(two.actors[0]), weights(two.actors[1])
    start = DiffusionPolicy.from_config(one.cfg.model).state_dict()
    assert max(float((w1[k] - start[k]).abs().max()) for k in w1) > 1e-3, "the warm start should move the weights"
    for w in (w2a, w2b):
        diff = max(float((w1[k] - w[k]).abs().max()) for k in w1)
        assert diff < 1e-5, f"2 ranks differ from 1 rank by {diff}"
    assert (tmp_path / "two" / r2["cache_key"] / "model.safetensors").is_file()  # rank 0 wrote the entry

    # a cache hit: rank 0 loads, and init_engine hands its weights to rank 1
    three = group(2, "two")
    r3 = ray.get(three.warm_start.remote(PAIRS))
    assert r3["cache_hit"] and r3["final_loss"] == pytest.approx(r2["final_loss"])
    ray.get(three.init_engine.remote())
    w3 = weights(three.actors[1])
    assert max(float((w3[k] - w2a[k]).abs().max()) for k in w3) < 1e-6
    for g in (one, two, three):
        g.shutdown()
