"""Policy families (SDAR, LLaDA, Dream): checkpoint round trips, LLaDA's names, Dream's shift, masked decoding, infilling."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from dice_ray.config import ModelConfig, SamplingConfig
from dice_ray.policy import sampler
from dice_ray.policy.model import forward_hidden, token_logits
from dice_ray.policy.policy import DiffusionPolicy
from dice_ray.policy.sampler import (
    infill_group,
    infill_ids,
    sample_group,
    sample_masked_ids,
    span_logits,
)

from _helpers import TINY_FAMILY_SHAPE

TINY = TINY_FAMILY_SHAPE
PROMPTS = ["import torch\n", "class Model(nn.Module):\n    def forward(self, x):\n", "x = 1\n"]
GREEDY = SamplingConfig(max_new_tokens=12, temperature=0.0, remasking="static", steps_per_block=2)


def _policy(family: str, tie: bool = True, seed: int = 0) -> DiffusionPolicy:
    return DiffusionPolicy.build(ModelConfig(family=family, tie_word_embeddings=tie, **TINY), seed=seed)


def _logits(policy: DiffusionPolicy, ids: torch.Tensor) -> torch.Tensor:
    n = ids.shape[1]
    h = forward_hidden(policy.model.eval(), ids, torch.arange(n), torch.ones(n, n, dtype=torch.bool))
    return token_logits(policy.model, h, policy.mask_id)


@pytest.mark.parametrize("family,tie", [("sdar", True), ("llada", False), ("llada", True), ("dream", False)])
def test_checkpoint_roundtrip_same_logits(tmp_path, family, tie):
    a = _policy(family, tie)
    a.save_checkpoint(tmp_path / "ckpt")
    raw = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert raw["model_type"] == {"sdar": "sdar", "llada": "llada", "dream": "Dream"}[family]
    b = DiffusionPolicy.load(tmp_path / "ckpt", ModelConfig(family=family, block_size=4))
    assert type(b.model) is type(a.model) and b.family == family and b.model_cfg.path == str(tmp_path / "ckpt")
    assert (b.mask_id, b.eos_id, b.pad_id) == (a.mask_id, a.eos_id, a.pad_id)
    assert b.model_cfg.hidden_size == 32 and b.model_cfg.tie_word_embeddings == tie
    ids = torch.tensor([a.encode("def f(x):\n    return x * 2\n")])
    torch.testing.assert_close(_logits(b, ids), _logits(a, ids), rtol=0, atol=1e-6)
    b.save(tmp_path / "again")  # a policy from a checkpoint folder is saved back in its format
    assert json.loads((tmp_path / "again" / "config.json").read_text())["model_type"] == raw["model_type"]
    with pytest.raises(ValueError, match="set model.family"):
        DiffusionPolicy.load(tmp_path / "ckpt", ModelConfig(family="dream" if family != "dream" else "llada"))


def test_sdar_checkpoint_finds_mask_token_by_name(tmp_path):
    a = _policy("sdar")
    a.save_checkpoint(tmp_path / "s")
    cfg = tmp_path / "s" / "config.json"
    raw = json.loads(cfg.read_text())
    del raw["mask_token_id"]  # SDAR's config.json has none: the tokenizer's mask token is looked up
    cfg.write_text(json.dumps(raw))
    assert DiffusionPolicy.load(tmp_path / "s").mask_id == a.mask_id


def _llada_reference_logits(w: dict, raw: dict, ids: torch.Tensor) -> torch.Tensor:
    """LLaDA's forward written from its own tensor names (RMSNorm, half-split RoPE, full attention, SwiGLU)."""
    d, nh, nkv, eps = raw["d_model"], raw["n_heads"], raw["n_kv_heads"], raw["rms_norm_eps"]
    hs, (B, T) = d // nh, ids.shape

    def rms(x, g):
        return g * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    inv = 1.0 / raw["rope_theta"] ** (torch.arange(0, hs, 2).float() / hs)
    f = torch.outer(torch.arange(T).float(), inv)
    sin, cos = torch.cat([f, f], -1).sin(), torch.cat([f, f], -1).cos()

    def rope(t):
        return t * cos + torch.cat([-t[..., hs // 2:], t[..., : hs // 2]], -1) * sin

    x = w["model.transformer.wte.weight"][ids]
    for i in range(raw["n_layers"]):
        p = f"model.transformer.blocks.{i}."
        h = rms(x, w[p + "attn_norm.weight"])
        q = (h @ w[p + "q_proj.weight"].T).view(B, T, nh, hs).transpose(1, 2)
        k = (h @ w[p + "k_proj.weight"].T).view(B, T, nkv, hs).transpose(1, 2).repeat_interleave(nh // nkv, 1)
        v = (h @ w[p + "v_proj.weight"].T).view(B, T, nkv, hs).transpose(1, 2).repeat_interleave(nh // nkv, 1)
        att = F.scaled_dot_product_attention(rope(q), rope(k), v)  # no mask: bidirectional
        x = x + att.transpose(1, 2).reshape(B, T, d) @ w[p + "attn_out.weight"].T
        h = rms(x, w[p + "ff_norm.weight"])
        x = x + (F.silu(h @ w[p + "ff_proj.weight"].T) * (h @ w[p + "up_proj.weight"].T)) @ w[p + "ff_out.weight"].T
    return rms(x, w["model.transformer.ln_f.weight"]) @ w["model.transformer.ff_out.weight"].T


def test_llada_checkpoint_names_follow_llada_math(tmp_path):
    a = _policy("llada", tie=False)
    a.save_checkpoint(tmp_path / "l")
    w = load_file(str(tmp_path / "l" / "model.safetensors"))
    raw = json.loads((tmp_path / "l" / "config.json").read_text())
    assert "model.transformer.blocks.1.ff_proj.weight" in w and "model.layers.0.mlp.up_proj.weight" not in w
    b = DiffusionPolicy.load(tmp_path / "l", ModelConfig(family="llada"))
    ids = torch.tensor([a.encode("y = torch.relu(x)\n")])
    n = ids.shape[1]
    h = forward_hidden(b.model.eval(), ids, torch.arange(n), torch.ones(n, n, dtype=torch.bool))
    with torch.no_grad():
        torch.testing.assert_close(b.model.lm_head(h), _llada_reference_logits(w, raw, ids), rtol=0, atol=1e-4)
    bad = dict(raw, attention_layer_norm=True)
    (tmp_path / "l" / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="attention_layer_norm"):
        DiffusionPolicy.load(tmp_path / "l")


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_denoising_reads_the_right_logits(family):
    """One greedy step unmasking all 4 positions equals argmax of a manual forward, shifted by one for Dream."""
    pol = _policy(family)
    prompt = pol.encode("def kernel(x):\n")
    P = len(prompt)
    cfg = SamplingConfig(max_new_tokens=4, temperature=0.0, remasking="static", steps_per_block=1)
    resp, steps, lps, _ = sample_masked_ids(pol, [prompt], cfg, torch.Generator().manual_seed(0))
    logits = _logits(pol, torch.tensor([prompt + [pol.mask_id] * 4]))[0]
    at_self, at_prev = logits[P : P + 4].argmax(-1).tolist(), logits[P - 1 : P + 3].argmax(-1).tolist()
    assert at_self != at_prev  # the check below can tell the two alignments apart
    assert resp[0] == (at_prev if family == "dream" else at_self)
    assert steps[0] == [0, 0, 0, 0]
    expected_lp = torch.log_softmax(logits[P - pol.logit_shift : P + 4 - pol.logit_shift], -1)
    torch.testing.assert_close(torch.tensor(lps[0]), expected_lp.gather(-1, torch.tensor(resp[0])[:, None])[:, 0])


def _eos_after(monkeypatch, eos_id: int, pos: int) -> None:
    """Make every span position >= ``pos`` predict eos with probability ~1."""
    real = sampler.token_logits

    def biased(model, hidden, mask_id):
        logits = real(model, hidden, mask_id)
        logits[..., pos:, eos_id] += 40.0
        return logits

    monkeypatch.setattr(sampler, "token_logits", biased)


def test_masked_sampling_stops_at_eos(monkeypatch):
    pol = _policy("llada")
    _eos_after(monkeypatch, pol.eos_id, 5)
    group = sample_group(pol, PROMPTS[0], 2, SamplingConfig(max_new_tokens=16, threshold=0.9), seed=0)
    for r in group:
        assert len(r.response_ids) == len(r.unmask_step) == len(r.behaviour_logprobs) == 6
        assert r.response_ids[-1] == pol.eos_id and pol.eos_id not in r.response_ids[:-1] and r.finished
        assert r.unmask_step[5] == 0 and sorted(r.unmask_step[:5]) == [1, 2, 3, 4, 5]  # one a step below 0.9
        assert all(lp <= 0 for lp in r.behaviour_logprobs) and pol.mask_id not in r.response_ids
    assert group.stats.forwards == 6  # eos block at step 0, then 5 steps; nothing after the eos is decoded


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_infill_keeps_prefix_suffix_and_fills_span(family):
    pol = _policy(family)
    prefix, suffix = "import torch\nsource = '''\n", "'''\nmodule = load_inline(source)\n"
    cfg = SamplingConfig(max_new_tokens=32, temperature=1.0, top_k=50, remasking="static", steps_per_block=2)
    group = infill_group(pol, prefix, suffix, 3, cfg, seed=1, span_len=7)
    for r in group:
        assert r.prompt_ids == pol.encode(prefix) and r.suffix_ids == pol.encode(suffix)
        assert len(r.response_ids) == len(r.unmask_step) == len(r.behaviour_logprobs) == 7
        assert pol.mask_id not in r.response_ids
        assert sorted(r.unmask_step) == [0, 0, 1, 1, 2, 2, 3]  # 2 tokens a step (4 / 2), every position once
        assert all(lp <= 0 for lp in r.behaviour_logprobs)
    # the span attends the suffix: another suffix changes the span's logits
    pre, span = pol.encode(prefix), [pol.mask_id] * 7
    rows = [torch.tensor(pre + span + pol.encode(s)) for s in (suffix, "y = 2\n")]
    a, b = (span_logits(pol, [r], [len(pre)], [7]) for r in rows)
    assert (a - b).nan_to_num().abs().max() > 1e-4  # (the mask column is -inf in both)


def test_infill_grows_the_span_until_the_end_marker(monkeypatch):
    pol = _policy("dream")
    _eos_after(monkeypatch, pol.eos_id, 6)
    cfg = SamplingConfig(max_new_tokens=16, temperature=0.0, threshold=0.9)
    gen = torch.Generator().manual_seed(0)
    spans, steps, lps, _ = infill_ids(pol, [pol.encode("a = ")], [pol.encode("\nb = a\n")], cfg, gen)
    # 4 masked; filled one a step without eos -> 8; positions 6, 7 are eos at step 4 -> positions 4, 5 -> cut at 6
    assert len(spans[0]) == len(steps[0]) == len(lps[0]) == 7 and spans[0][-1] == pol.eos_id
    assert pol.eos_id not in spans[0][:-1]
    assert sorted(steps[0][:4]) == [0, 1, 2, 3] and steps[0][6] == 4 and sorted(steps[0][4:6]) == [5, 6]
    fixed, _, _, _ = infill_ids(pol, [pol.encode("a = ")], [pol.encode("\n")], cfg, gen, span_len=9)
    assert len(fixed[0]) == 9 and fixed[0][6:] == [pol.eos_id] * 3  # a fixed span is filled whole


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_batched_prompts_equal_one_at_a_time(family):
    pol = _policy(family, seed=2)
    ids = [pol.encode(p) for p in PROMPTS]
    assert len({len(i) for i in ids}) == 3
    batch = sample_masked_ids(pol, ids, GREEDY, torch.Generator().manual_seed(0))
    alone = [sample_masked_ids(pol, [i], GREEDY, torch.Generator().manual_seed(0)) for i in ids]
    for k in range(3):
        assert batch[0][k] == alone[k][0][0] and batch[1][k] == alone[k][1][0]
        torch.testing.assert_close(torch.tensor(batch[2][k]), torch.tensor(alone[k][2][0]))
    sufs = [pol.encode(s) for s in ("\n", "return y\n", "")]
    both = infill_ids(pol, ids, sufs, GREEDY, torch.Generator(), span_len=5)
    for k in range(3):
        assert both[0][k] == infill_ids(pol, [ids[k]], [sufs[k]], GREEDY, torch.Generator(), span_len=5)[0][0]


def test_family_errors():
    sdar, llada, dream = _policy("sdar"), _policy("llada"), _policy("dream")
    with pytest.raises(ValueError, match="bidirectional family"):
        infill_group(sdar, "a", "b", 1, GREEDY, seed=0)
    with pytest.raises(ValueError, match="must not be empty"):
        infill_ids(dream, [[]], [[5]], GREEDY, torch.Generator(), span_len=3)
    with pytest.raises(ValueError, match="span_len"):
        infill_ids(llada, [[5]], [[6]], GREEDY, torch.Generator(), span_len=0)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        sample_masked_ids(llada, [[5]], SamplingConfig(max_new_tokens=512), torch.Generator())
    with pytest.raises(ValueError, match="head_dim"):
        DiffusionPolicy.build(ModelConfig(family="llada", **dict(TINY, head_dim=16)))


def test_hub_id_loads_from_the_local_hub_cache_without_network(tmp_path, monkeypatch):
    """``model.path`` may be a hub id (``org/name[@revision]``): a snapshot in the local hub cache (the layout
    huggingface_hub writes: models--org--name/{refs,snapshots}) loads with no network; an id that is not there
    fails, naming the id, when offline."""
    a = _policy("llada", False)
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--dice-test--tiny-llada"
    a.save_checkpoint(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    (repo / "refs" / "v1").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("dice-test/tiny-llada", "dice-test/tiny-llada@v1"):
        b = DiffusionPolicy.load(name, ModelConfig(family="llada", block_size=4))
        assert b.family == "llada" and b.model_cfg.path.endswith(commit)
        ids = torch.tensor([a.encode("x = 1\n")])
        torch.testing.assert_close(_logits(b, ids), _logits(a, ids), rtol=0, atol=1e-6)
    with pytest.raises(FileNotFoundError, match="'dice-test/absent'.*HF_HUB_OFFLINE"):
        DiffusionPolicy.load("dice-test/absent")
    with pytest.raises(FileNotFoundError, match="not a hub id"):
        DiffusionPolicy.load(str(tmp_path / "no" / "such" / "folder"))
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="'runs/typo': no such folder in 'runs'"):  # not a hub download
        DiffusionPolicy.load("runs/typo")


def _break_json(name: str, text: str):
    return lambda d: (d / name).write_text(text)


def _retype(d):
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**raw, "model_type": "gpt2"}))


# how a saved folder is broken -> (which format, the error, what it must say)
BROKEN_FOLDERS = {
    "checkpoint without tokenizer.json": ("checkpoint", lambda d: (d / "tokenizer.json").unlink(), FileNotFoundError,
                                          "missing tokenizer.json"),
    "checkpoint without weights": ("checkpoint", lambda d: [f.unlink() for f in d.glob("*.safetensors")],
                                   FileNotFoundError, r"missing \*\.safetensors$"),
    "config.json not JSON": ("checkpoint", _break_json("config.json", "{model_type: sdar"), ValueError,
                             "config.json is not valid JSON"),
    "config.json a list": ("checkpoint", _break_json("config.json", "[1, 2]"), ValueError, "holds a list, not a JSON object"),
    "unknown model_type": ("checkpoint", _retype, ValueError, "model_type 'gpt2' is not one of"),
    "policy without weights": ("policy", lambda d: (d / "model.safetensors").unlink(), FileNotFoundError,
                               "missing model.safetensors"),
    "model_config.json not JSON": ("policy", _break_json("model_config.json", "{"), ValueError,
                                   "model_config.json is not a valid model config"),
    "model_config.json bad field": ("policy", _break_json("model_config.json", '{"hidden_size": "big"}'), ValueError,
                                    "model_config.json is not a valid model config .*hidden_size"),
    "neither format": ("policy", lambda d: [f.unlink() for f in d.iterdir()], FileNotFoundError,
                       "neither a dice-ray policy folder .* nor an SDAR / LLaDA / Dream checkpoint folder"),
    # every problem in one error, not one a run (a fresh user fixed a folder in three rounds)
    "only a config.json, not JSON": ("checkpoint", lambda d: [f.unlink() for f in d.iterdir() if f.name != "config.json"]
                                     and (d / "config.json").write_text("not json"), FileNotFoundError,
                                     r"missing tokenizer.json, \*\.safetensors; config.json is not valid JSON"),
    "only a config.json, empty": ("checkpoint", lambda d: [f.unlink() for f in d.iterdir() if f.name != "config.json"]
                                  and (d / "config.json").write_text("{}"), FileNotFoundError,
                                  r"missing tokenizer.json, \*\.safetensors; config.json model_type None is not one of"),
    "policy without weights, bad config": ("policy", lambda d: (d / "model.safetensors").unlink()
                                           or (d / "model_config.json").write_text('{"hidden_size": "big"}'),
                                           FileNotFoundError, "missing model.safetensors; model_config.json is not a "
                                           "valid model config .*hidden_size"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_FOLDERS))
def test_a_broken_policy_folder_is_named_by_check_path_and_load_alike(tmp_path, case):
    """``DiffusionPolicy.check_path`` (what ``dice-ray train`` runs on ``model.path`` before any actor starts) refuses
    a folder for the same reason, with the same words, as :meth:`DiffusionPolicy.load` would in every actor."""
    fmt, breaks, error, says = BROKEN_FOLDERS[case]
    folder = tmp_path / fmt
    if fmt == "checkpoint":
        _policy("sdar").save_checkpoint(folder)
    else:
        DiffusionPolicy.build(ModelConfig(**TINY), seed=0).save(folder)
    assert DiffusionPolicy.check_path(folder) == folder  # intact, it passes
    breaks(folder)
    with pytest.raises(error, match=says):
        DiffusionPolicy.check_path(folder)
    with pytest.raises(error, match=says):
        DiffusionPolicy.load(folder)


def test_check_path_names_the_family_a_checkpoint_needs(tmp_path):
    _policy("sdar").save_checkpoint(tmp_path / "s")
    with pytest.raises(ValueError, match="checkpoint .*: model.family='llada' but it holds a 'sdar' model.*set model.family=sdar"):
        DiffusionPolicy.check_path(tmp_path / "s", ModelConfig(family="llada"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileNotFoundError, match="not a folder"):
        DiffusionPolicy.check_path(tmp_path / "file")


def test_a_train_run_directory_stands_for_its_newest_policy(tmp_path):
    """``model.path`` (train) and ``--model`` (eval) may name a run directory: both load its newest checkpoint's policy."""
    run = tmp_path / "run"
    DiffusionPolicy.build(ModelConfig(**TINY), seed=0).save(run / "checkpoints" / "step_000002" / "policy")
    (run / "checkpoints" / "step_000004").mkdir()  # being written: no policy yet
    assert DiffusionPolicy.check_path(run) == run / "checkpoints" / "step_000002" / "policy"
    assert DiffusionPolicy.load(run).model_cfg.path == str(run / "checkpoints" / "step_000002" / "policy")
