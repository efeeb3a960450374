"""FlexAttention over the block mask (``cluster.learner_attention``) and the compiled learner layers
(``cluster.learner_compile``) against today's path (SDPA over the dense mask, eager layers), on CPU in fp32.

PyTorch has no FlexAttention backward on CPU: the gradient tests lift that guard (``_validate_device``) and run its
unfused reference, which applies the ``mask_mod`` to every pair and ignores the BlockMask's tile tables. The tables
are checked against the dense mask directly, and through compiled FlexAttention (which uses them) in no-grad passes.
The ``gpu`` tests repeat the comparison in bf16 on CUDA with the real kernels.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.attention.flex_attention as fa
from pydantic import ValidationError

from dice_ray.config import ModelConfig, SamplingConfig, load_config
from dice_ray.policy import compiled as compiled_mod
from dice_ray.policy import model as model_mod
from dice_ray.policy.compiled import compile_blocker, compile_layers, is_compiled
from dice_ray.policy.logprobs import response_logprobs
from dice_ray.policy.model import (
    KVCache, attention_of, block_mask, build_model, flex_block_mask, forward_hidden, prompt_blocks, response_blocks,
    set_attention, token_logits,
)
from dice_ray.policy.policy import DiffusionPolicy
from dice_ray.policy.sampler import sample_ids

SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256, "block_size": 4}
"""A tiny model FlexAttention's kernel takes (head_dim a power of two >= 16); GQA 2:1; LLaDA / Dream need
heads * head_dim == hidden."""
V = 97


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch):
    """8 x 8 tiles, so the short test sequences span several (some skipped, some full, some partial), and a fresh
    conversion memo."""
    monkeypatch.setattr(model_mod, "FLEX_BLOCK", 8)
    monkeypatch.setitem(model_mod._flex_state, "memo", None)


@pytest.fixture
def cpu_flex_grad(monkeypatch):
    """Let PyTorch's FlexAttention reference run backward on CPU (see the module docstring)."""
    monkeypatch.setattr(fa, "_validate_device", lambda *a, **k: None)


def _sdar(seed: int = 0):
    torch.manual_seed(seed)
    return build_model(ModelConfig(**SHAPE), V, 0).train()


def _xt_x0(P: int = 6, R: int = 16, bs: int = 4, copies: int = 2):
    """Prompt ‖ clean response ‖ ``copies`` noisy copies (the x_t ‖ x_0 layout) with several blocks: blocks, copies,
    positions."""
    pb = prompt_blocks(P, bs)
    rb, rpos = response_blocks(P, R, bs)
    blocks = torch.cat([pb, rb] + [rb] * copies)
    copy_ids = torch.cat([torch.zeros(P + R, dtype=torch.long)] + [torch.full((R,), c) for c in range(1, copies + 1)])
    pos = torch.cat([torch.arange(P), rpos] + [rpos] * copies)
    return blocks, copy_ids, pos


def _trace(G: int = 3, P: int = 6, R: int = 16, bs: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, V - 1, (P,), generator=g)
    resp = torch.randint(0, V - 1, (G, R), generator=g)
    steps = torch.rand(G, R // bs, bs, generator=g).argsort(-1).view(G, R) % bs
    return prompt, resp, steps, torch.ones(G, R, dtype=torch.bool)


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


# ---- the BlockMask is the dense mask ----------------------------------------------------------------------------


@pytest.mark.parametrize("batched", [False, True])
def test_block_mask_tiles_are_the_dense_mask_reduced(batched):
    blocks, copies, _ = _xt_x0()
    dense = block_mask(blocks, copies, blocks, copies)
    if batched:  # a per-row mask (SFT's padding, the bidirectional families' spans): row 1 hides its last 5 keys
        dense = torch.stack([dense, dense.clone()])
        dense[1, :, -5:] = False
    bm = flex_block_mask(dense)
    t = 8
    q, kv = dense.shape[-2:]
    pad = torch.zeros(*dense.shape[:-2], -(-q // t) * t, -(-kv // t) * t, dtype=torch.bool)
    pad[..., :q, :kv] = dense
    tiles = pad.unflatten(-1, (-1, t)).unflatten(-3, (-1, t))  # [..., nq, t, nkv, t]
    any_ = tiles.any(-1).any(-2)
    got = bm.to_dense()[:, 0] if batched else bm.to_dense()[0, 0]
    assert torch.equal(got.bool(), any_)  # a tile is visited exactly when one of its pairs is attended
    assert (~any_).any() and any_.any()  # some tiles are skipped: the point of it
    # the mask_mod is the dense mask, pair by pair
    b = torch.zeros((), dtype=torch.long)
    for qi, ki in [(0, 0), (q - 1, kv - 1), (7, 30), (30, 7), (q // 2, kv // 2)]:
        want = dense[-1, qi, ki] if batched else dense[qi, ki]
        got_pair = bm.mask_mod(b + (1 if batched else 0), b, torch.tensor(qi), torch.tensor(ki))
        assert bool(got_pair) == bool(want)


def test_block_mask_conversion_is_remembered_for_the_same_mask():
    blocks, copies, _ = _xt_x0()
    m = block_mask(blocks, copies, blocks, copies)
    a = flex_block_mask(m)
    assert flex_block_mask(m) is a  # the noisy passes of a group share one conversion
    m[0, -1] = True  # written in place: converted anew
    assert flex_block_mask(m) is not a
    assert flex_block_mask(m.clone()) is not flex_block_mask(m)


# ---- flex == sdpa: forward (public API, no grad) ---------------------------------------------------------------


def test_flex_forward_equals_sdpa_on_the_xt_x0_layout():
    model = _sdar().eval()
    blocks, copies, pos = _xt_x0()
    mask = block_mask(blocks, copies, blocks, copies)
    ids = torch.randint(0, V, (2, blocks.numel()), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = token_logits(model, forward_hidden(model, ids, pos, mask), V - 1)
        assert set_attention(model, "flex") == "flex" and attention_of(model) == "flex"
        got = token_logits(model, forward_hidden(model, ids, pos, mask), V - 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_flex_forward_equals_sdpa_with_a_training_cache():
    """The learner's passes: the prompt once (batch 1, expanded), the clean response, then noisy copies (keep=0)."""
    model = _sdar().eval()
    P, R, bs = 6, 16, 4
    prompt, resp, steps, _ = _trace(P=P, R=R, bs=bs)
    pb = prompt_blocks(P, bs)
    rb, rpos = response_blocks(P, R, bs)
    zp, zr, ones = torch.zeros(P, dtype=torch.long), torch.zeros(R, dtype=torch.long), torch.ones(R, dtype=torch.long)
    k_block = torch.cat([pb, rb])

    def passes():
        cache = KVCache()
        out = [forward_hidden(model, prompt[None], torch.arange(P), block_mask(pb, zp, pb, zp), cache)]
        cache.expand(resp.shape[0])
        out.append(forward_hidden(model, resp, rpos, block_mask(rb, zr, k_block, torch.zeros_like(k_block)), cache))
        noisy_mask = block_mask(rb, ones, torch.cat([k_block, rb]), torch.cat([torch.zeros_like(k_block), ones]))
        for s in range(bs):
            noisy = torch.where(steps < s, resp, torch.full_like(resp, V - 1))
            out.append(forward_hidden(model, noisy, rpos, noisy_mask, cache, keep=0))
        return out

    with torch.no_grad():
        want = passes()
        set_attention(model, "flex")
        got = passes()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_flex_keeps_sdpa_for_a_preallocated_cache():
    """The sampler's capacity cache (its CUDA-graph path) stays on SDPA: no BlockMask is built for it."""
    model = _sdar().eval()
    set_attention(model, "flex")
    blocks, copies, pos = _xt_x0(copies=0)
    mask = block_mask(blocks, copies, blocks, copies)
    ids = torch.randint(0, V, (1, blocks.numel()))
    cache = KVCache(capacity=blocks.numel())
    cache.next_slots(blocks.numel(), "cpu")
    with torch.no_grad():
        got = forward_hidden(model, ids, pos, cache.pad_mask(mask), cache)
        set_attention(model, "sdpa")
        want = forward_hidden(model, ids, pos, mask)
    assert model_mod._flex_state["memo"] is None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_no_cache_sampling_is_the_same_under_flex():
    """The sampler's no-cache passes (SDAR's re-run of the whole sequence, LLaDA's full-attention span) under flex."""
    cfg = SamplingConfig(max_new_tokens=12, temperature=1.0)
    for family in ("sdar", "llada"):
        policy = DiffusionPolicy.build(ModelConfig(family=family, **SHAPE), seed=0)
        policy.eos_id = -1
        want = sample_ids(policy, list(range(5, 14)), 3, cfg, torch.Generator().manual_seed(1), kv_cache=False)
        set_attention(policy.model, "flex")
        got = sample_ids(policy, list(range(5, 14)), 3, cfg, torch.Generator().manual_seed(1), kv_cache=False)
        assert got[0] == want[0] and got[1] == want[1], family
        assert max(abs(x - y) for r, s in zip(got[2], want[2]) for x, y in zip(r, s)) < 1e-4


def test_flex_follows_the_block_rule():
    """Independent of SDPA: under flex a query never sees a later block (nor another noisy copy)."""
    model = _sdar().eval()
    set_attention(model, "flex")
    blocks, copies, pos = _xt_x0(copies=2)
    mask = block_mask(blocks, copies, blocks, copies)
    ids = torch.randint(0, V - 1, (1, blocks.numel()), generator=torch.Generator().manual_seed(3))
    P, R = 6, 16
    with torch.no_grad():
        h = forward_hidden(model, ids, pos, mask)
        later = ids.clone()
        later[0, P + R - 4: P + R] = V - 1  # the last clean block
        later[0, P + 2 * R:] = V - 1  # noisy copy 2
        d = (forward_hidden(model, later, pos, mask) - h).abs().amax(-1)[0]
    assert d[: P + R - 4].max() < 1e-6  # prompt and earlier clean blocks do not see the last clean block
    assert d[P + R: P + 2 * R].max() < 1e-6  # noisy copy 1 sees neither copy 2 nor its own clean block
    assert d[P + R - 4: P + R].min() > 1e-4 and d[P + 2 * R:].min() > 1e-4  # what changed does change


# ---- flex == sdpa: gradients (the learner's estimators) -------------------------------------------------------


@pytest.mark.parametrize("estimator", ["tracerl", "coupled", "diffu_grpo"])
def test_flex_logprobs_and_gradients_equal_sdpa(estimator, cpu_flex_grad):
    prompt, resp, steps, rmask = _trace()

    def run(kind):
        model = _sdar()
        set_attention(model, kind)
        lp = response_logprobs(estimator, model, prompt, resp, steps, rmask, 4, V - 1, seed=5)
        (lp * torch.linspace(-1, 1, lp.numel()).view_as(lp)).sum().backward()
        return lp.detach(), _grads(model)

    (lp_s, g_s), (lp_f, g_f) = run("sdpa"), run("flex")
    torch.testing.assert_close(lp_f, lp_s, rtol=1e-5, atol=1e-5)
    assert max(g.abs().max() for g in g_s) > 0
    for a, b in zip(g_f, g_s):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("passes", [None, 6])
def test_flex_scores_every_noisy_state_in_one_stacked_pass(passes, cpu_flex_grad):
    """Under FlexAttention SDAR's noisy states run as one pass (prompt, clean, stacked: 3 model calls, whatever the
    number of states, padding states included), with the log-probs and gradients of SDPA's one pass a state."""
    prompt, resp, steps, rmask = _trace()
    assert int(steps.max()) + 1 == 4  # four TraceRL states

    def run(kind):
        model = _sdar()
        set_attention(model, kind)
        calls = []
        model.model.register_forward_pre_hook(lambda m, a, k: calls.append(k["input_ids"].shape), with_kwargs=True)
        lp = response_logprobs("tracerl", model, prompt, resp, steps, rmask, 4, V - 1, passes=passes)
        (lp * torch.linspace(-1, 1, lp.numel()).view_as(lp)).sum().backward()
        return lp.detach(), _grads(model), calls

    (lp_s, g_s, calls_s), (lp_f, g_f, calls_f) = run("sdpa"), run("flex")
    states = passes or 4
    assert calls_s == [(1, 6)] + [(3, 16)] * (1 + states)
    assert calls_f == [(1, 6), (3, 16), (3, 16 * states)]
    torch.testing.assert_close(lp_f, lp_s, rtol=1e-5, atol=1e-5)
    assert max(g.abs().max() for g in g_s) > 0
    for a, b in zip(g_f, g_s):  # fp32 sums in another order (the padded pass's softmax spans more keys)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_flex_equals_sdpa_on_an_infill_span_with_suffix(family, cpu_flex_grad):
    """LLaDA / Dream infilling: prompt ‖ growing span ‖ suffix, rows of different span lengths (padding)."""
    G, P, R, S, bs = 3, 5, 8, 4, 4
    g = torch.Generator().manual_seed(2)
    prompt, suffix = torch.randint(0, 90, (P,), generator=g), torch.randint(0, 90, (S,), generator=g)
    resp = torch.randint(0, 90, (G, R), generator=g)
    steps = torch.tensor([[0, 0, 1, 1, 2, 2, 3, 3]] * G)
    span = torch.tensor([[4, 4, 8, 8], [4, 8, 8, 8], [8, 8, 8, 8]])  # row 0 grows late, row 2 never

    def run(kind):
        policy = DiffusionPolicy.build(ModelConfig(family=family, **SHAPE), seed=0)
        policy.model.train()
        set_attention(policy.model, kind)
        lp = response_logprobs("tracerl", policy.model, prompt, resp, steps, torch.ones(G, R, dtype=torch.bool), bs,
                               policy.mask_id, suffix_ids=suffix, span_lens=span)
        (lp * torch.linspace(-1, 1, lp.numel()).view_as(lp)).sum().backward()
        return lp.detach(), _grads(policy.model)

    (lp_s, g_s), (lp_f, g_f) = run("sdpa"), run("flex")
    torch.testing.assert_close(lp_f, lp_s, rtol=1e-5, atol=1e-5)
    for a, b in zip(g_f, g_s):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


# ---- the switches ----------------------------------------------------------------------------------------------


def test_attention_switch_and_config():
    model = _sdar()
    assert attention_of(model) == "sdpa"  # today's path unless asked
    assert set_attention(model, "auto") == "sdpa"  # auto: flex on CUDA only
    assert attention_of(copy.deepcopy(model)) == "sdpa"
    assert set_attention(model, "flex") == "flex" and attention_of(copy.deepcopy(model)) == "flex"
    with pytest.raises(ValueError, match="attention='bogus'"):
        set_attention(model, "bogus")
    odd = build_model(ModelConfig(**{**SHAPE, "head_dim": 8}), V, 0)
    with pytest.raises(ValueError, match="head_dim 8 is not a power of two >= 16"):
        set_attention(odd, "flex")
    assert set_attention(odd, "auto") == "sdpa"

    cfg = load_config(None, [])
    assert cfg.cluster.learner_attention == "sdpa" and cfg.cluster.learner_compile is False
    assert load_config(None, ["cluster.learner_attention=flex", "cluster.learner_gpus=1"]).cluster.learner_attention == "flex"
    with pytest.raises((ValidationError, ValueError), match="learner_attention='flex' needs a GPU learner"):
        load_config(None, ["cluster.learner_attention=flex"])
    with pytest.raises((ValidationError, ValueError), match="learner_compile=true does not work with cluster.zero_stage=3"):
        load_config(None, ["cluster.learner_compile=true", "cluster.zero_stage=3"])
    assert load_config(None, ["cluster.learner_compile=true", "cluster.learner_attention=auto"]).cluster.learner_compile


# ---- compiled layers --------------------------------------------------------------------------------------------


def test_compile_layers_installs_a_deepcopy_safe_forward():
    model = _sdar()
    assert compile_blocker(model) is None and not is_compiled(model)
    assert compile_layers(model) == SHAPE["num_hidden_layers"] and is_compiled(model)
    twin = copy.deepcopy(model)
    for a, b in zip(model.model.layers, twin.model.layers):
        assert a.forward.__self__ is a and b.forward.__self__ is b  # bound to its own layer, copies too
    with pytest.raises(ValueError, match="compile_layers: .*no model.layers"):
        compile_layers(torch.nn.Linear(2, 2))


@pytest.fixture
def fresh_compile(monkeypatch):
    """New compiled functions (and no failure recorded) for the test; ``backend`` picks Dynamo's backend."""
    torch._dynamo.reset()
    for key in ("pre", "post", "head", "broken"):
        monkeypatch.setitem(compiled_mod._state, key, None)
    return lambda backend: monkeypatch.setitem(compiled_mod._state, "backend", backend)


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.gpu)])
def test_compiled_layers_equal_eager_logprobs_and_gradients(backend, fresh_compile):
    """torch.compile of the decoder layers and the log-prob head: the learner's TraceRL pass equals the eager model's,
    forward and backward; the two layers share one compiled graph a region and shape. On CPU through Dynamo and
    AOTAutograd (``aot_eager``: tracing, graph sharing, the split layer's math and its backward; Inductor's code
    generation takes minutes on a small CPU), with Inductor on a GPU machine (still on CPU tensors)."""
    from torch._dynamo.utils import counters

    fresh_compile(backend)
    counters.clear()
    prompt, resp, steps, rmask = _trace()
    ref, model = _sdar(), _sdar()
    compile_layers(model)

    def run(m):
        lp = response_logprobs("tracerl", m, prompt, resp, steps, rmask, 4, V - 1)
        (lp * torch.linspace(-1, 1, lp.numel()).view_as(lp)).sum().backward()
        return lp.detach(), _grads(m)

    (lp_e, g_e), (lp_c, g_c) = run(ref), run(model)
    assert compiled_mod.compile_fallback_reason() is None  # it really compiled
    torch.testing.assert_close(lp_c, lp_e, rtol=1e-5, atol=1e-5)
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # pre / post: one static graph (the prompt pass, batch 1) and one dynamic (batch 3); the head: one or two
    assert counters["stats"]["unique_graphs"] <= 6
    model.zero_grad()
    run(model)
    assert counters["stats"]["unique_graphs"] <= 6  # a second step compiles nothing


def test_compiled_layers_with_compiled_flex_equal_eager_sdpa(fresh_compile):
    """No-grad passes through compiled layers with FlexAttention inside (Inductor's CPU FlexAttention, which does
    read the BlockMask's tile tables) equal eager SDPA."""
    fresh_compile("inductor")
    model = _sdar().eval()
    blocks, copies, pos = _xt_x0()
    mask = block_mask(blocks, copies, blocks, copies)
    ids = torch.randint(0, V, (2, blocks.numel()), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = forward_hidden(model, ids, pos, mask)
        compile_layers(model)
        set_attention(model, "flex")
        got = forward_hidden(model, ids, pos, mask)
    assert compiled_mod.compile_fallback_reason() is None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_compile_failure_falls_back_to_eager_once(monkeypatch, capsys):
    def broken(fn, **kw):
        def run(*a, **k):  # what Dynamo raises when a backend fails (it wraps the backend's error)
            raise torch._dynamo.exc.InternalTorchDynamoError("no compiler here\nmore")
        return run

    monkeypatch.setattr(torch, "compile", broken)
    for key in ("pre", "post", "head", "broken"):
        monkeypatch.setitem(compiled_mod._state, key, None)  # monkeypatch restores them: later tests compile afresh
    prompt, resp, steps, rmask = _trace()
    ref, model = _sdar(), _sdar()
    compile_layers(model)
    want = response_logprobs("tracerl", ref, prompt, resp, steps, rmask, 4, V - 1)
    got = response_logprobs("tracerl", model, prompt, resp, steps, rmask, 4, V - 1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    err = capsys.readouterr().err
    assert err.count("torch.compile of the learner's layers failed (InternalTorchDynamoError: no compiler here)") == 1
    assert "no compiler here" in compiled_mod.compile_fallback_reason()
    assert "failed earlier" in compile_blocker(model)


def test_an_error_of_the_layer_itself_is_not_a_compile_failure(monkeypatch):
    """An exception that is not Dynamo's (here a ValueError of the layer's math) passes through: nothing falls back."""
    def failing(fn, **kw):
        def run(*a, **k):
            raise ValueError("bad shapes")
        return run

    monkeypatch.setattr(torch, "compile", failing)
    for key in ("pre", "post", "head", "broken"):
        monkeypatch.setitem(compiled_mod._state, key, None)
    prompt, resp, steps, rmask = _trace()
    model = _sdar()
    compile_layers(model)
    with pytest.raises(ValueError, match="bad shapes"):
        response_logprobs("tracerl", model, prompt, resp, steps, rmask, 4, V - 1)
    assert compiled_mod.compile_fallback_reason() is None


def test_compiled_layers_under_activation_checkpointing_equal_eager(fresh_compile):
    """Compiled layers inside non-reentrant ``torch.utils.checkpoint`` (the learner's ``gradient_checkpointing``, the
    benchmark's ``--grad-ckpt layers``): the recomputation's early stop passes through the compiled regions (it was
    taken for a compile failure: "target_frame.early_stop is set"); gradients equal the eager model's, nothing
    falls back."""
    from torch.utils.checkpoint import checkpoint

    fresh_compile("aot_eager")
    prompt, resp, steps, rmask = _trace()
    ref, model = _sdar(), _sdar()
    compile_layers(model)
    def checkpointed(fwd):  # the layer checkpointed in the noisy passes (their cache is not written), as the
        def layer(*args, **kwargs):  # benchmark's --grad-ckpt layers does
            cache = kwargs.get("block_kv")
            if cache is not None and cache.keep == 0:
                return checkpoint(fwd, *args, use_reentrant=False, **kwargs)
            return fwd(*args, **kwargs)
        return layer

    for m in (ref, model):
        for layer in m.model.layers:
            layer.forward = checkpointed(layer.forward)

    def run(m):
        lp = response_logprobs("tracerl", m, prompt, resp, steps, rmask, 4, V - 1)
        (lp * torch.linspace(-1, 1, lp.numel()).view_as(lp)).sum().backward()
        return _grads(m)

    want, got = run(ref), run(model)
    assert compiled_mod.compile_fallback_reason() is None
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# ---- on a GPU: the real kernels, bf16 -----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["flex", "sdpa+compile", "flex+compile"])
def test_gpu_variants_equal_sdpa_within_bf16(variant, monkeypatch):
    monkeypatch.setattr(model_mod, "FLEX_BLOCK", 128)
    P, R, bs, G = 200, 256, 4, 4  # several 128-tiles, a prompt not a multiple of them
    prompt, resp, steps, rmask = _trace(G=G, P=P, R=R, bs=bs)
    prompt, resp, steps, rmask = (t.cuda() for t in (prompt, resp, steps, rmask))

    def run(kind, compiled):
        torch.manual_seed(0)
        cfg = ModelConfig(**{**SHAPE, "hidden_size": 256, "num_attention_heads": 4, "head_dim": 64,
                             "max_position_embeddings": 1024, "dtype": "bfloat16"})
        model = build_model(cfg, V, 0).cuda().train()
        set_attention(model, kind)
        if compiled:
            compile_layers(model)
        lp = response_logprobs("tracerl", model, prompt, resp, steps, rmask, bs, V - 1)
        (lp * torch.linspace(-1, 1, lp.numel(), device="cuda").view_as(lp)).sum().backward()
        return lp.detach().float(), [p.grad.float() for p in model.parameters()]

    lp_s, g_s = run("sdpa", False)
    lp_v, g_v = run(variant.split("+")[0], variant.endswith("+compile"))
    assert model_mod.flex_fallback_reason() is None and compiled_mod.compile_fallback_reason() is None
    torch.testing.assert_close(lp_v, lp_s, rtol=2e-2, atol=5e-2)
    for a, b in zip(g_v, g_s):
        assert (a - b).norm() <= 5e-2 * b.norm() + 1e-6


# ---- benchmarks/learner_throughput.py --variants --------------------------------------------------------------


def _bench():
    import importlib.util
    import sys
    from pathlib import Path

    bench_dir = Path(__file__).resolve().parents[1] / "benchmarks"
    for name in ("rollout_throughput", "learner_throughput"):  # the second imports the first by this name
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, bench_dir / f"{name}.py")
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
    return sys.modules["learner_throughput"]


def test_benchmark_variants_options(capsys):
    bench = _bench()
    args = bench.parse_args(["--device", "cpu", "--tiny"])
    assert args.variants == ["sdpa"] and args.fused == ["none"]  # today's path, one run in this process
    args = bench.parse_args(["--device", "cuda", "--fused", "liger", "--variants", "sdpa,flex,flex+compile"])
    assert args.variants == ["sdpa", "flex", "flex+compile"] and args.fused == ["liger"]
    for bad, said in (("sdpa,fast", "must be one of"), ("flex,flex", "twice")):
        with pytest.raises(SystemExit):
            bench.parse_args(["--device", "cpu", "--variants", bad])
        assert said in capsys.readouterr().err
    assert bench._child_argv(["--tiny", "--variants", "sdpa,flex+compile", "--profile=p.txt", "--out", "a.json"],
                             "none", "t.json", "flex+compile") == [
        "--tiny", "--profile", "p.flex-compile.none.txt", "--fused", "none", "--variants", "flex+compile", "--out",
        "t.json"]


def test_benchmark_prints_the_variants_side_by_side(tmp_path, monkeypatch, capsys):
    import json
    import subprocess
    from pathlib import Path

    bench = _bench()
    speed = {"sdpa": 1000.0, "flex": 1250.0, "flex+compile": 1600.0}

    def fake_run(cmd, **kwargs):
        variant, out = cmd[cmd.index("--variants") + 1], cmd[cmd.index("--out") + 1]
        assert cmd[cmd.index("--fused") + 1] == "liger"
        if variant == "sdpa+compile":
            return subprocess.CompletedProcess(cmd, 1, stderr="Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory\n")
        tps = speed[variant]
        Path(out).write_text(json.dumps({
            "seconds": 4000.0 / tps, "processed_tokens_per_s": tps, "mfu": tps / 4000, "matmul_mfu": tps / 5000,
            "peak_gib": 40.0, "first_loss": -0.0123, "device": "NVIDIA H200",
            "fallback": "TritonError: x" if variant == "flex" else ""}))
        return subprocess.CompletedProcess(cmd, 0, stderr="")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    argv = ["--device", "cuda", "--fused", "liger", "--variants", "sdpa,flex,sdpa+compile,flex+compile", "--out",
            str(tmp_path / "v.json")]
    res = bench.compare_variants(bench.parse_args(argv), argv)
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["sdpa", "4.000", "1000", "25.0%", "20.0%", "40.0"] in rows
    assert ["flex+compile", "2.500", "1600", "40.0%", "32.0%", "40.0"] in rows
    assert ["sdpa+compile", "failed:", "exit", "1:", "torch.OutOfMemoryError:", "CUDA", "out", "of", "memory"] in rows
    text = "\n".join(" ".join(r) for r in rows)
    assert "flex+compile 1.60x the first row, loss of the first update -0.012300" in text
    assert "FELL BACK: TritonError: x" in text
    assert "best MFU: flex+compile 40.0% (target >= 45%: NOT met)" in text
    assert res["speedup_vs_first"] == pytest.approx({"sdpa": 1.0, "flex": 1.25, "flex+compile": 1.6})
    assert json.loads((tmp_path / "v.json").read_text())["variants"]["flex"]["mfu"] == 0.3125
