"""The block-causal Qwen3 model, its KV cache, the tokenizer and DiffusionPolicy save/load."""

from __future__ import annotations

import pytest
import torch

from dice_ray.config import ModelConfig
from dice_ray.policy.model import KVCache, block_mask, build_model, forward_hidden, response_blocks
from dice_ray.policy.policy import DiffusionPolicy
from dice_ray.policy.tokenizer import DiceTokenizer, train_tokenizer

TINY = ModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, max_position_embeddings=512, block_size=4)


def _layout(P: int, R: int, bs: int):
    rb, rpos = response_blocks(P, R, bs)
    blocks = torch.cat([torch.zeros(P, dtype=torch.long), rb])
    copies = torch.zeros(P + R, dtype=torch.long)
    return blocks, copies, torch.cat([torch.arange(P), rpos])


def test_block_mask_rule():
    # prompt (block 0, 2 tokens), clean block 1, clean block 2, noisy block 1, noisy block 2 (1 token each)
    blocks = torch.tensor([0, 0, 1, 2, 1, 2])
    copies = torch.tensor([0, 0, 0, 0, 1, 1])
    m = block_mask(blocks, copies, blocks, copies).int().tolist()
    assert m == [
        [1, 1, 0, 0, 0, 0],  # prompt sees the prompt only
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],  # clean block 1: prompt + itself
        [1, 1, 1, 1, 0, 0],  # clean block 2: prompt + clean 1 + itself
        [1, 1, 0, 0, 1, 0],  # noisy block 1: prompt + itself (not clean block 1)
        [1, 1, 1, 0, 0, 1],  # noisy block 2: prompt + clean block 1 + itself
    ]


def test_response_blocks_rejects_partial_block():
    with pytest.raises(ValueError, match="multiple of block_size"):
        response_blocks(5, 6, 4)


def test_attention_is_block_causal():
    torch.manual_seed(0)
    model = build_model(TINY, 64, 0).eval()
    P, R, bs = 6, 12, 4
    blocks, copies, pos = _layout(P, R, bs)
    mask = block_mask(blocks, copies, blocks, copies)
    ids = torch.randint(3, 64, (1, P + R))
    h = forward_hidden(model, ids, pos, mask)

    later = ids.clone()
    later[0, P + 9] = (later[0, P + 9] + 1) % 64  # response block 3
    d = (forward_hidden(model, later, pos, mask) - h).abs().amax(-1)[0]
    assert d[: P + 8].max() < 1e-6  # prompt and blocks 1-2 untouched
    assert d[P + 8 :].min() > 1e-4  # every token of block 3 changes (bidirectional within the block)

    same = ids.clone()
    same[0, P + 5] = (same[0, P + 5] + 1) % 64  # response block 2
    d = (forward_hidden(model, same, pos, mask) - h).abs().amax(-1)[0]
    assert d[: P + 4].max() < 1e-6
    assert d[P + 4 :].min() > 1e-4  # its block (incl. the earlier position P+4) and later blocks change

    prompt = ids.clone()
    prompt[0, P - 1] = (prompt[0, P - 1] + 1) % 64  # the prompt is one bidirectional block
    d = (forward_hidden(model, prompt, pos, mask) - h).abs().amax(-1)[0]
    assert d.min() > 1e-4


def test_cache_equals_full_pass_and_peek_keeps_nothing():
    torch.manual_seed(1)
    model = build_model(TINY, 64, 0).eval()
    P, R, bs = 5, 8, 4
    blocks, copies, pos = _layout(P, R, bs)
    mask = block_mask(blocks, copies, blocks, copies)
    ids = torch.randint(3, 64, (2, P + R))
    full = forward_hidden(model, ids, pos, mask)
    cache = KVCache()
    a = forward_hidden(model, ids[:, :P], pos[:P], mask[:P, :P], cache)
    b = forward_hidden(model, ids[:, P:], pos[P:], mask[P:], cache, keep=0)
    assert len(cache) == P  # keep=0: a read-only pass
    c = forward_hidden(model, ids[:, P:], pos[P:], mask[P:], cache, keep=bs)
    assert len(cache) == P + bs
    torch.testing.assert_close(torch.cat([a, b], 1), full, atol=1e-5, rtol=0)
    torch.testing.assert_close(c, b, atol=1e-6, rtol=0)


def test_preallocated_cache_gives_the_concatenating_caches_outputs():
    """The sampler's in-place cache (capacity set: new keys at slots, the whole buffer attended under a padded
    mask, the caller commits) gives the concatenating cache's hidden states through a prefill, a peek (its
    scratch keys overwritten by the next pass), a commit and a last pass; it refuses to overflow, to run
    with autograd on and to run without slots."""
    torch.manual_seed(2)
    model = build_model(TINY, 64, 0).eval()
    P, R, bs = 5, 8, 4
    blocks, copies, pos = _layout(P, R, bs)
    mask = block_mask(blocks, copies, blocks, copies)
    ids = torch.randint(3, 64, (3, P + R))
    peek = ids[:, P : P + bs].flip(0)  # other tokens than the commit below: must leave no trace
    passes = [  # (ids, query positions, keep)
        (ids[:, :P], slice(0, P), None),
        (peek, slice(P, P + bs), 0),
        (ids[:, P : P + bs], slice(P, P + bs), bs),
        (ids[:, P + bs :], slice(P + bs, P + R), None),
    ]
    outs = []
    with torch.no_grad():
        for cache in (KVCache(), KVCache(capacity=P + R + 2)):  # 2 positions never written: hidden by the mask
            got = []
            for x, qs, keep in passes:
                m = mask[qs, : qs.stop]
                if cache.capacity is None:
                    got.append(forward_hidden(model, x, pos[qs], m, cache, keep=keep))
                else:
                    cache.next_slots(x.shape[1], "cpu")
                    got.append(forward_hidden(model, x, pos[qs], cache.pad_mask(m), cache))
                    cache.commit(x.shape[1] if keep is None else keep)
            assert len(cache) == P + R
            outs.append(got)
        for x, y in zip(*outs):
            torch.testing.assert_close(x, y, atol=1e-6, rtol=0)
        full = KVCache(capacity=P)
        full.next_slots(P, "cpu")
        full.commit(P)
        with pytest.raises(RuntimeError, match="capacity 5 exceeded"):
            full.next_slots(1, "cpu")
        with pytest.raises(RuntimeError, match="set slots"):
            forward_hidden(model, ids[:, :P], pos[:P], mask[:P, :P], KVCache(capacity=P))
    with pytest.raises(RuntimeError, match="torch.no_grad"):
        forward_hidden(model, ids[:, :P], pos[:P], mask[:P, :P], KVCache(capacity=P))
    with pytest.raises(ValueError, match="capacity=0"):
        KVCache(capacity=0)


@pytest.mark.parametrize("heads,kv_heads,mask_batch", [(4, 2, 1), (8, 2, 3), (4, 4, 3)])
def test_gqa_attention_reads_shared_kv_heads_in_place(heads, kv_heads, mask_batch):
    """The stacked-query GQA equals attention with the keys repeated per query head (repeat_interleave)."""
    from types import SimpleNamespace

    from dice_ray.policy.model import _block_attention

    g = torch.Generator().manual_seed(0)
    B, q, kv, D = 3, 5, 9, 8
    query = torch.randn(B, q, heads, D, generator=g).transpose(1, 2)  # a strided view, as transformers passes it
    key, value = torch.randn(2, B, kv_heads, kv, D, generator=g)
    mask = torch.rand(mask_batch, 1, q, kv, generator=g) > 0.4
    mask[..., 0] = True  # every query attends something
    out, _ = _block_attention(SimpleNamespace(training=False), query, key, value, mask, scaling=D ** -0.5)
    rep = heads // kv_heads
    k, v = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    scores = (query @ k.transpose(-1, -2)) * D ** -0.5
    want = (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v).transpose(1, 2)
    assert out.shape == (B, q, heads, D)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["sdar", "llada", "dream"])
def test_every_family_runs_torchs_rms_norm_with_the_same_state_dict(family):
    """Built models hold :class:`RMSNorm` (torch's fused kernel) in place of transformers' modules, under the same
    parameter names, and it computes transformers' RMSNorm: equal in fp32, within one bf16 rounding in bf16."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from dice_ray.policy.families import build_model as build_family
    from dice_ray.policy.model import RMSNorm

    cfg = TINY.model_copy(update={"family": family, "head_dim": 8, "hidden_size": 32})
    model = build_family(cfg, vocab_size=64, pad_id=0)
    norms = [m for m in model.modules() if "RMSNorm" in type(m).__name__]
    assert norms and all(type(m) is RMSNorm for m in norms)
    assert "model.norm.weight" in model.state_dict()
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2 ** -7)):
        x = torch.randn(5, 3, 32, generator=g).to(dtype)
        hf = Qwen3RMSNorm(32, eps=1e-6).to(dtype)
        with torch.no_grad():
            hf.weight.copy_(torch.rand(32, generator=g) + 0.5)
        ours = RMSNorm(hf.weight, hf.variance_epsilon)
        want = hf(x)
        assert ours(x).dtype == dtype
        torch.testing.assert_close(ours(x).float(), want.float(), rtol=tol, atol=tol * want.float().abs().max().item())


def test_model_refuses_a_pass_without_block_mask():
    model = build_model(TINY, 64, 0)
    with pytest.raises(ValueError, match="explicit boolean block mask"):
        model(input_ids=torch.randint(0, 64, (1, 8)))


def test_tokenizer_roundtrip_and_specials():
    tok = DiceTokenizer.load()
    assert (tok.pad_id, tok.mask_id, tok.eos_id) == (0, 1, 2)
    assert 2048 <= tok.vocab_size <= 4096
    text = 'extern "C" __global__ void k(float* y) {\n    y[0] = 1.f;  // é ✓\n}\n'
    assert tok.decode(tok.encode(text)) == text
    ids = tok.encode("a <|mask|> b <|eos|>")  # spelled specials stay text
    assert not {tok.pad_id, tok.mask_id, tok.eos_id} & set(ids)
    assert tok.decode(ids) == "a <|mask|> b <|eos|>"


def test_train_tokenizer_small_corpus():
    tok = train_tokenizer(["int x = 1;\nint y = 2;\n"] * 3, vocab_size=300)
    assert tok.decode(tok.encode("int z = 3;\n")) == "int z = 3;\n"
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["x"], vocab_size=10)


def test_policy_build_save_load(tmp_path):
    a = DiffusionPolicy.build(TINY, seed=3)
    b = DiffusionPolicy.build(TINY, seed=3)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k])  # build is deterministic in the seed
    assert a.block_size == 4 and a.mask_id == 1 and a.eos_id == 2 and a.pad_id == 0
    a.save(tmp_path / "p")
    c = DiffusionPolicy.load(tmp_path / "p")
    assert c.model_cfg.hidden_size == TINY.hidden_size and c.model_cfg.path == str(tmp_path / "p")
    ids = torch.tensor([a.encode("import torch\nx = 1\n")])
    n = ids.shape[1]
    m = torch.ones(n, n, dtype=torch.bool)
    torch.testing.assert_close(forward_hidden(a.model.eval(), ids, torch.arange(n), m),
                               forward_hidden(c.model.eval(), ids, torch.arange(n), m))
    c.load_state_dict(DiffusionPolicy.build(TINY, seed=4).state_dict())
    assert not torch.equal(c.state_dict()["model.embed_tokens.weight"], a.state_dict()["model.embed_tokens.weight"])
    with pytest.raises(FileNotFoundError, match="no such folder"):
        DiffusionPolicy.load(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="neither a dice-ray policy folder .* nor an SDAR / LLaDA / Dream checkpoint folder"):
        DiffusionPolicy.load(tmp_path / "empty")
