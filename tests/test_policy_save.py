"""Saving a policy whose parameters are views into one flat buffer (as DeepSpeed ZeRO leaves them)."""

import torch

from dice_ray.config import ModelConfig
from dice_ray.policy.policy import DiffusionPolicy


def test_save_load_round_trip_with_flattened_tied_parameters(tmp_path):
    policy = DiffusionPolicy.build(ModelConfig(hidden_size=32, intermediate_size=64, head_dim=8), seed=1)
    flat = torch.cat([p.detach().flatten() for p in policy.model.parameters()])
    offset = 0
    for p in policy.model.parameters():
        p.data = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    policy.save(tmp_path / "policy")
    loaded = DiffusionPolicy.load(tmp_path / "policy")
    a, b = policy.model.state_dict(), loaded.model.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
