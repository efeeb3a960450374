"""The policy on a CUDA GPU: sampler and TraceRL agree, SFT steps run (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from dice_ray.config import ModelConfig, SamplingConfig, SFTConfig
from dice_ray.policy.logprobs import tracerl_logprobs
from dice_ray.policy.policy import DiffusionPolicy
from dice_ray.policy.sampler import sample_group
from dice_ray.policy.sft_warm_start import warm_start

PROMPT = 'Reference:\nimport torch\nclass Model(nn.Module):\n    def forward(self, x):\n        return torch.relu(x)\n'


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("remasking", ["static", "dynamic"])
def test_gpu_sampler_agrees_with_tracerl(dtype, remasking):
    policy = DiffusionPolicy.build(ModelConfig(dtype=dtype), seed=0).to("cuda")
    with torch.no_grad():
        policy.model.model.norm.weight.mul_(40.0)  # peaked, so dynamic remasking unmasks in parallel
    cfg = SamplingConfig(max_new_tokens=64, remasking=remasking, threshold=0.5)
    group = sample_group(policy, PROMPT, 4, cfg, seed=0)
    R = max(len(r.response_ids) for r in group)
    resp = torch.zeros(4, R, dtype=torch.long)
    step = torch.zeros(4, R, dtype=torch.long)
    mask = torch.zeros(4, R, dtype=torch.bool)
    blp = torch.zeros(4, R)
    for i, r in enumerate(group):
        n = len(r.response_ids)
        resp[i, :n], step[i, :n], mask[i, :n] = torch.tensor(r.response_ids), torch.tensor(r.unmask_step), True
        blp[i, :n] = torch.tensor(r.behaviour_logprobs)
    lp = tracerl_logprobs(policy.model, torch.tensor(group[0].prompt_ids), resp, step, mask, 4, policy.mask_id)
    assert lp.device.type == "cuda"
    err = (lp.detach().cpu() - blp)[mask].abs()
    if dtype == "float32":
        assert err.max() < 1e-3, err.max()
    else:  # bf16 logits: the two passes round differently
        assert err.mean() < 0.05, err.mean()


@pytest.mark.gpu
def test_gpu_warm_start_runs(tmp_path):
    policy = DiffusionPolicy.build(ModelConfig(), seed=0).to("cuda")
    pairs = [("Reference: relu\n", 'extern "C" __global__ void relu(float* y) { y[0] = 0.f; }\n')]
    cfg = SFTConfig(steps=60, batch_size=1, log_every=10, target_loss=None, cache_dir=str(tmp_path))
    report = warm_start(policy, pairs, cfg, seed=0)
    assert report.steps == 60 and report.final_loss < 0.5 * report.losses[0][1]
    again = DiffusionPolicy.build(ModelConfig(), seed=0).to("cuda")
    assert warm_start(again, pairs, cfg, seed=0).cache_hit


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_cuda_graph_sampler_matches_eager(dtype):
    """The block sampler with its cached forward replayed as CUDA graphs gives the eager sampler's tokens, unmask
    steps and behaviour log-probs, with rows ending (an <|eos|> stand-in) while others go on (both keep finished
    rows in the batch, fully unmasked)."""
    from dice_ray.policy.sampler import sample_ids

    policy = DiffusionPolicy.build(ModelConfig(dtype=dtype), seed=0).to("cuda")
    with torch.no_grad():
        policy.model.model.norm.weight.mul_(40.0)  # confident: dynamic remasking unmasks several tokens a step
    prompt = list(range(5, 40))
    cfg = SamplingConfig(max_new_tokens=48, remasking="dynamic", threshold=0.5, temperature=1.0)
    policy.eos_id = -1
    first, _, _, _ = sample_ids(policy, prompt, 6, cfg.model_copy(update={"cuda_graphs": False}),
                                torch.Generator(device="cuda").manual_seed(3))
    policy.eos_id = next(t for r in first for t in r[4:12] if any(t not in other[:12] for other in first))
    runs = [sample_ids(policy, prompt, 6, cfg.model_copy(update={"cuda_graphs": graphs}),
                       torch.Generator(device="cuda").manual_seed(3)) for graphs in (False, True)]
    (tok_e, step_e, lp_e, _), (tok_g, step_g, lp_g, _) = runs
    lengths = [len(r) for r in tok_e]
    assert min(lengths) < max(lengths)  # some rows stopped while others went on
    assert tok_g == tok_e and step_g == step_e
    assert max(abs(x - y) for r, s in zip(lp_e, lp_g) for x, y in zip(r, s)) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_cuda_graph_batched_groups_match_eager(dtype):
    """Groups of prompts of different lengths in one batch (left-padded: per-row positions [B, q] and masks
    [B, q, C] go into the recorded graphs): replayed CUDA graphs give the eager batch's tokens, unmask steps and
    behaviour log-probs, with rows ending while others go on; in fp32 each group also gets what it gets alone
    (bf16 rounds the batched GEMMs differently, so alone-vs-batched is compared in fp32 only)."""
    from dice_ray.policy.sampler import sample_ids, sample_ids_batch

    policy = DiffusionPolicy.build(ModelConfig(dtype=dtype), seed=0).to("cuda")
    with torch.no_grad():
        policy.model.model.norm.weight.mul_(40.0)
    prompts = [list(range(5, 40)), list(range(50, 57)), list(range(60, 83))]
    cfg = SamplingConfig(max_new_tokens=48, remasking="dynamic", threshold=0.5, temperature=1.0)

    def gens():
        return [torch.Generator(device="cuda").manual_seed(s) for s in (3, 4, 5)]

    policy.eos_id = -1
    first, _ = sample_ids_batch(policy, prompts, 4, cfg.model_copy(update={"cuda_graphs": False}), gens())
    rows = [r for resp, _, _ in first for r in resp]
    policy.eos_id = next(t for r in rows for t in r[4:12] if any(t not in other[:12] for other in rows))
    runs = [sample_ids_batch(policy, prompts, 4, cfg.model_copy(update={"cuda_graphs": graphs}), gens())[0]
            for graphs in (False, True)]
    eager, graphed = runs
    lengths = [len(r) for resp, _, _ in eager for r in resp]
    assert min(lengths) < max(lengths)  # some rows stopped while others went on
    for (tok_e, step_e, lp_e), (tok_g, step_g, lp_g) in zip(eager, graphed):
        assert tok_g == tok_e and step_g == step_e
        assert max(abs(x - y) for r, s in zip(lp_e, lp_g) for x, y in zip(r, s)) < 1e-4
    if dtype == "float32":
        for prompt, g, (tok, step, lp) in zip(prompts, gens(), graphed):
            a_tok, a_step, a_lp, _ = sample_ids(policy, prompt, 4, cfg, g)
            assert a_tok == tok and a_step == step
            assert max(abs(x - y) for r, s in zip(a_lp, lp) for x, y in zip(r, s)) < 1e-3
