"""configs/cluster-8b.yaml with ``model.path`` at an SDAR-format checkpoint folder (what DICE releases:
``config.json`` of model_type ``sdar`` or ``qwen3``, safetensors, ``tokenizer.json`` with a mask token), faked
here tiny: the preset's cluster and learner settings load unchanged, the policy gets the folder's weights
and shape (not the preset's 8B shape keys), and the preset's block size and dtype."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dice_ray.config import ModelConfig, load_config
from dice_ray.policy.model import block_mask, forward_hidden, token_logits
from dice_ray.policy.policy import DiffusionPolicy

PRESET = Path(__file__).resolve().parents[1] / "configs" / "cluster-8b.yaml"
TINY = ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, max_position_embeddings=256, rope_theta=5000.0,
                   tie_word_embeddings=False, dtype="bfloat16")


def _checkpoint(folder: Path, model_type: str, mask_in_config: bool) -> DiffusionPolicy:
    """A tiny bf16 SDAR policy written as a checkpoint folder (``save_checkpoint``), DICE-style config keys."""
    policy = DiffusionPolicy.build(TINY, seed=3)
    policy.save_checkpoint(folder)
    raw = json.loads((folder / "config.json").read_text())
    assert raw["model_type"] == "sdar" and not (folder / "model_config.json").exists()
    raw["model_type"] = model_type
    if not mask_in_config:  # DICE's config.json has no mask_token_id: the tokenizer's mask token is used
        del raw["mask_token_id"]
    (folder / "config.json").write_text(json.dumps(raw))
    return policy


def _logits(policy: DiffusionPolicy, ids: torch.Tensor) -> torch.Tensor:
    """The policy's logits of ``ids`` [1, n] under SDAR's block-causal mask (clean blocks of ``block_size``)."""
    n = ids.shape[1]
    block, copy = torch.arange(n) // policy.block_size, torch.zeros(n, dtype=torch.long)
    with torch.no_grad():
        h = forward_hidden(policy.model.eval(), ids, torch.arange(n), block_mask(block, copy, block, copy))
        return token_logits(policy.model, h, policy.mask_id)


@pytest.mark.parametrize("model_type, mask_in_config", [("sdar", False), ("qwen3", True)])
def test_cluster_8b_preset_loads_an_sdar_checkpoint_folder(tmp_path, model_type, mask_in_config):
    saved = _checkpoint(tmp_path / "ckpt", model_type, mask_in_config)
    preset = load_config(PRESET)
    cfg = load_config(PRESET, [f"model.path={tmp_path / 'ckpt'}"])

    # everything but model.path is the preset's: GPU split, ZeRO stage, no warm start, RL and decoding
    assert cfg.model_dump(exclude={"model": {"path"}}) == preset.model_dump(exclude={"model": {"path"}})
    c = cfg.cluster
    assert (c.num_verifiers, c.num_rollout_workers, c.learner_ranks, c.learner_gpus, c.zero_stage) == (4, 4, 8, 1.0, 3)
    assert c.num_verifiers * c.verifier_gpus + c.num_rollout_workers * c.rollout_gpus + c.learner_ranks * c.learner_gpus == 16
    assert not cfg.sft.enabled and cfg.model.family == "sdar" and cfg.model.dtype == "bfloat16"

    policy = DiffusionPolicy.from_config(cfg.model)
    m = policy.model_cfg
    # the folder's shape replaces the preset's 8B keys; block size, dtype and family are the preset's
    shape = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "max_position_embeddings", "rope_theta", "tie_word_embeddings")
    assert {k: getattr(m, k) for k in shape} == {k: getattr(TINY, k) for k in shape}
    assert m.hidden_size != preset.model.hidden_size
    assert (m.block_size, m.dtype, m.family, m.path) == (4, "bfloat16", "sdar", str(tmp_path / "ckpt"))
    assert (policy.mask_id, policy.eos_id, policy.pad_id) == (saved.mask_id, saved.eos_id, saved.pad_id)
    assert policy.tokenizer.encode("__global__ void k()") == saved.tokenizer.encode("__global__ void k()")

    # the checkpoint's weights, in bf16: equal tensors and equal logits
    got, want = policy.state_dict(), saved.state_dict()
    assert got.keys() == want.keys()
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], want[k]) for k in want)
    ids = torch.tensor([saved.encode("y = torch.relu(x)") + [saved.mask_id] * 4])
    assert torch.equal(_logits(policy, ids), _logits(saved, ids))
    assert not torch.equal(_logits(DiffusionPolicy.build(TINY, seed=4), ids), _logits(saved, ids))  # seed matters


def test_cluster_8b_preset_refuses_a_checkpoint_of_another_family(tmp_path):
    _checkpoint(tmp_path / "ckpt", "sdar", True)
    raw = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({**raw, "model_type": "Dream"}))
    cfg = load_config(PRESET, [f"model.path={tmp_path / 'ckpt'}"])
    with pytest.raises(ValueError, match="model.family='sdar'.*'dream'"):
        DiffusionPolicy.from_config(cfg.model)
