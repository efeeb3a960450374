"""TraceRL log-probs: agree with the sampler's behaviour log-probs and with a brute-force recomputation."""

from __future__ import annotations

import pytest
import torch

from dice_ray.config import ModelConfig, SamplingConfig
from dice_ray.policy.logprobs import tracerl_logprobs
from dice_ray.policy.model import block_mask, build_model, forward_hidden, token_logits
from dice_ray.policy.policy import DiffusionPolicy
from dice_ray.policy.sampler import sample_group, sample_groups

TINY = ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, max_position_embeddings=512, block_size=4)
PROMPT = 'Reference:\nimport torch\nclass Model(nn.Module):\n    def forward(self, x):\n        return torch.relu(x)\n'


def _pad(group, block_size):
    G, R = len(group), max(len(r.response_ids) for r in group)
    resp = torch.zeros(G, R, dtype=torch.long)
    step = torch.zeros(G, R, dtype=torch.long)
    mask = torch.zeros(G, R, dtype=torch.bool)
    blp = torch.zeros(G, R)
    for i, r in enumerate(group):
        n = len(r.response_ids)
        assert n % block_size == 0
        resp[i, :n] = torch.tensor(r.response_ids)
        step[i, :n] = torch.tensor(r.unmask_step)
        mask[i, :n] = True
        blp[i, :n] = torch.tensor(r.behaviour_logprobs)
    return resp, step, mask, blp


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(max_new_tokens=32, remasking="dynamic", threshold=0.5, temperature=1.0),
        SamplingConfig(max_new_tokens=32, remasking="static", steps_per_block=4, temperature=1.0),
        SamplingConfig(max_new_tokens=32, remasking="static", steps_per_block=2, temperature=0.7, top_k=20, top_p=0.9),
    ],
    ids=["dynamic", "static4", "static2-tempered"],
)
def test_tracerl_equals_sampler_behaviour_logprobs(sampling):
    policy = DiffusionPolicy.build(TINY, seed=0)
    # sharpen the random model so dynamic remasking unmasks several tokens in some steps
    with torch.no_grad():
        policy.model.model.norm.weight.mul_(40.0)
    group = sample_group(policy, PROMPT, 3, sampling, seed=5)
    resp, step, mask, blp = _pad(group, policy.block_size)
    assert step.max() < policy.block_size and policy.mask_id not in resp
    if sampling.remasking == "dynamic":
        assert (step == 0).sum() > resp.numel() // 4  # parallel unmasking happened
    lp = tracerl_logprobs(policy.model, torch.tensor(group[0].prompt_ids), resp, step, mask,
                          policy.block_size, policy.mask_id)
    assert lp.shape == resp.shape and lp.dtype == torch.float32
    err = (lp - blp)[mask].abs().max().item()
    assert err < 1e-4, f"sampler and TraceRL disagree by {err}"


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(max_new_tokens=32, remasking="dynamic", threshold=0.5, temperature=1.0),
        SamplingConfig(max_new_tokens=32, remasking="static", steps_per_block=2, temperature=0.7, top_k=20, top_p=0.9),
    ],
    ids=["dynamic", "static2-tempered"],
)
def test_tracerl_equals_batched_sampler_behaviour_logprobs(sampling):
    """Groups of prompts of different lengths decoded in one batch (left-padded, sample_groups): each group's
    behaviour log-probs and unmask steps are what the learner's TraceRL replay of its own, unpadded, prompt gives."""
    policy = DiffusionPolicy.build(TINY, seed=0)
    with torch.no_grad():
        policy.model.model.norm.weight.mul_(40.0)
    prompts = [PROMPT, "import torch\n", PROMPT + "    # and a longer one, so three prompt lengths share the batch\n"]
    assert len({len(policy.encode(p)) for p in prompts}) == 3
    groups = sample_groups(policy, prompts, 3, sampling, [5, 6, 7])
    for prompt, group in zip(prompts, groups):
        resp, step, mask, blp = _pad(group, policy.block_size)
        assert group[0].prompt_ids == policy.encode(prompt) and step.max() < policy.block_size
        lp = tracerl_logprobs(policy.model, torch.tensor(group[0].prompt_ids), resp, step, mask,
                              policy.block_size, policy.mask_id)
        err = (lp - blp)[mask].abs().max().item()
        assert err < 1e-4, f"batched sampler and TraceRL disagree by {err} (prompt of {len(group[0].prompt_ids)} tokens)"


def test_tracerl_against_brute_force_per_step_recomputation():
    torch.manual_seed(0)
    V, bs, mask_id = 11, 4, 1
    model = build_model(TINY, V, 0).eval()
    P, G, nb = 5, 3, 3
    R = nb * bs
    prompt = torch.randint(3, V, (P,))
    resp = torch.randint(2, V, (G, R))
    # a valid trace per block: a random order, tokens grouped into steps 0..k-1 (every step unmasks >= 1)
    step = torch.zeros(G, R, dtype=torch.long)
    for g in range(G):
        for b in range(nb):
            order = torch.randperm(bs)
            n_steps = int(torch.randint(1, bs + 1, ()))
            cuts = sorted(torch.randperm(bs - 1)[: n_steps - 1].add(1).tolist())
            s_of_rank = torch.zeros(bs, dtype=torch.long)
            for c in cuts:
                s_of_rank[c:] += 1
            step[g, b * bs + order] = s_of_rank
    valid = torch.ones(G, R, dtype=torch.bool)
    valid[2, 2 * bs :] = False  # row 2 is one block shorter (padding block)

    got = tracerl_logprobs(model, prompt, resp, step, valid, bs, mask_id)

    want = torch.zeros(G, R)
    for g in range(G):
        for b in range(nb):
            if not valid[g, b * bs]:
                continue
            for s in range(bs):
                sl = slice(b * bs, (b + 1) * bs)
                here = step[g, sl] == s
                if not here.any():
                    continue
                noisy = torch.where(step[g, sl] < s, resp[g, sl], torch.full((bs,), mask_id))
                seq = torch.cat([prompt, resp[g, : b * bs], noisy])[None]
                L = seq.shape[1]
                blocks = torch.cat([-((P - 1 - torch.arange(P)) // bs), torch.arange((b + 1) * bs) // bs + 1])
                m = block_mask(blocks, torch.zeros(L, dtype=torch.long), blocks, torch.zeros(L, dtype=torch.long))
                h = forward_hidden(model, seq, torch.arange(L), m)[0, -bs:]
                lp = torch.log_softmax(token_logits(model, h, mask_id), -1).gather(-1, resp[g, sl][:, None])[:, 0]
                want[g, sl] = torch.where(here, lp, want[g, sl])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (got[~valid] == 0).all()


def test_tracerl_is_differentiable():
    policy = DiffusionPolicy.build(TINY, seed=1)
    group = sample_group(policy, PROMPT, 2, SamplingConfig(max_new_tokens=16, remasking="static"), seed=0)
    resp, step, mask, _ = _pad(group, 4)
    prompt = torch.tensor(group[0].prompt_ids)
    policy.model.train()
    lp = tracerl_logprobs(policy.model, prompt, resp, step, mask, 4, policy.mask_id)
    lp.sum().backward()
    grads = {n: p.grad for n, p in policy.model.named_parameters()}
    assert all(g is not None for g in grads.values())
    assert grads["model.layers.0.self_attn.q_proj.weight"].abs().sum() > 0
    with torch.no_grad():  # one ascent step raises the log-likelihood of the sampled trace
        for p in policy.model.parameters():
            p.add_(p.grad, alpha=1e-2)
    lp2 = tracerl_logprobs(policy.model, prompt, resp, step, mask, 4, policy.mask_id)
    assert lp2.sum() > lp.sum()


def test_tracerl_rejects_bad_input():
    model = build_model(TINY, 11, 0)
    resp = torch.zeros(2, 8, dtype=torch.long)
    ok = torch.ones(2, 8, dtype=torch.bool)
    with pytest.raises(ValueError, match="multiple of block_size"):
        tracerl_logprobs(model, torch.tensor([3, 4]), resp[:, :6], resp[:, :6], ok[:, :6], 4, 1)
    with pytest.raises(ValueError, match="unmask_step"):
        tracerl_logprobs(model, torch.tensor([3, 4]), resp, resp + 4, ok, 4, 1)
    with pytest.raises(ValueError, match="response_mask"):
        tracerl_logprobs(model, torch.tensor([3, 4]), resp, resp, ok[:1], 4, 1)
    with pytest.raises(ValueError, match="prompt_ids"):
        tracerl_logprobs(model, torch.tensor([], dtype=torch.long), resp, resp, ok, 4, 1)
