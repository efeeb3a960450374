"""dice_ray.policy.graphs on CPU: the eager cached forward and the clear errors (recording runs in test_policy_gpu)."""

from __future__ import annotations

import pytest
import torch

from dice_ray.config import ModelConfig, SamplingConfig
from dice_ray.policy.graphs import CachedForward
from dice_ray.policy.model import KVCache, block_mask, build_model, forward_hidden


def _model():
    torch.manual_seed(0)
    return build_model(ModelConfig(), vocab_size=64, pad_id=0).eval()


def test_cached_forward_refuses_graphs_off_cuda_and_a_cache_without_capacity():
    model = _model()
    with pytest.raises(ValueError, match="CUDA graphs need the model on a CUDA device, it is on cpu"):
        CachedForward(model, KVCache(capacity=8), graphs=True)
    with pytest.raises(ValueError, match="preallocated KVCache"):
        CachedForward(model, KVCache(), graphs=False)


def test_eager_cached_forward_is_forward_hidden_over_the_cache():
    model = _model()
    blocks = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    copies = torch.zeros(8, dtype=torch.long)
    mask = block_mask(blocks, copies, blocks, copies)
    ids = torch.randint(3, 60, (2, 8), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(8)
    with torch.no_grad():
        want = forward_hidden(model, ids, pos, mask)
        cache = KVCache(capacity=10)
        cache.next_slots(4, "cpu")
        first = forward_hidden(model, ids[:, :4], pos[:4], cache.pad_mask(mask[:4, :4]), cache)
        cache.commit(4)
        run = CachedForward(model, cache, graphs=False)
        cache.next_slots(4, "cpu")
        second = run(ids[:, 4:], pos[4:], cache.pad_mask(mask[4:]))
    torch.testing.assert_close(torch.cat([first, second], 1), want, atol=1e-5, rtol=0)
    assert run.recordings == 0


def test_sampling_config_has_cuda_graphs_on_by_default():
    assert SamplingConfig().cuda_graphs is True
    assert SamplingConfig(cuda_graphs=False).cuda_graphs is False
