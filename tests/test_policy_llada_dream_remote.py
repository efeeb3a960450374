"""LLaDA's and Dream's public remote code vs dice-ray's transformers-native loading (issue 5): same logits.

dice-ray loads LLaDA into ``LlamaForCausalLM`` (weights renamed by ``LLADA_TO_LLAMA``) and Dream into
``Qwen2ForCausalLM``, both with full (bidirectional) attention through the ``dice_block`` attention, and never runs
the checkpoints' remote code. Here a random tiny model of the remote classes is saved with its own
``save_pretrained``, loaded by :func:`dice_ray.policy.families.load_checkpoint`, and both score the same batch
(fp32, max abs logit difference <= 1e-5), with and without padding; a causal mask on our side must give a large
difference (the test can fail). Dream's logits are compared unshifted (its one-position shift is the sampler's,
:func:`dice_ray.policy.families.logit_shift`).

The remote code is not vendored: ``DICE_LLADA_REMOTE_CODE`` names a folder with ``modeling_llada.py`` +
``configuration_llada.py`` (GSAI-ML's LLaDA remote code), ``DICE_DREAM_REMOTE_CODE`` one with ``modeling_dream.py``
+ ``configuration_dream.py`` + ``generation_utils.py`` (Dream-org's). A family without its folder is skipped.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

from dice_ray.policy import families
from dice_ray.policy.model import forward_hidden
from dice_ray.policy.tokenizer import DiceTokenizer

TOL = 1e-5
SHAPE = {"hidden_size": 32, "intermediate_size": 64, "layers": 2, "heads": 4, "kv_heads": 2}  # _helpers' TINY
_LLADA_FILES = ("modeling_llada.py", "configuration_llada.py")
_DREAM_FILES = ("modeling_dream.py", "configuration_dream.py", "generation_utils.py")


def _folder(env: str, files: tuple[str, ...]) -> Path | None:
    value = os.environ.get(env, "")
    return Path(value) if value and all((Path(value) / f).is_file() for f in files) else None


LLADA_DIR = _folder("DICE_LLADA_REMOTE_CODE", _LLADA_FILES)
DREAM_DIR = _folder("DICE_DREAM_REMOTE_CODE", _DREAM_FILES)
needs_llada = pytest.mark.skipif(LLADA_DIR is None, reason=(
    f"DICE_LLADA_REMOTE_CODE must name a folder holding {' and '.join(_LLADA_FILES)} (LLaDA's remote code)"))
needs_dream = pytest.mark.skipif(DREAM_DIR is None, reason=(
    f"DICE_DREAM_REMOTE_CODE must name a folder holding {', '.join(_DREAM_FILES)} (Dream's remote code)"))


def _pair(remote, tok, tmp_path_factory, family: str, rope_theta: float):
    """Randomize the remote model and load it through dice-ray's loader: ``(remote, ours, tokenizer)``."""
    _randomize(remote, 1)
    ours, mcfg = _load_ours(remote, tok, tmp_path_factory, family)
    assert mcfg.family == family and mcfg.rope_theta == rope_theta
    return remote, ours, tok


def _import_modeling(folder: Path, package: str, module: str):
    """The remote modeling module, imported as a package (relative imports work) with the folder also on
    sys.path (copies that import their configuration module by its plain name work too)."""
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    if package not in sys.modules:
        spec = importlib.util.spec_from_file_location(package, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])
        sys.modules[package] = importlib.util.module_from_spec(spec)
    return importlib.import_module(f"{package}.{module}")


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random (norm gains around 1), so a dropped or misnamed tensor shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if "norm" in name or "ln_f" in name else 0.1 * noise)


def _batch(tok, T: int = 18) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [2, T] (some masked), key-valid BoolTensor[2, T] (row 1 padded at its end)."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, tok.vocab_size, (2, T), generator=gen)
    ids[:, T // 2: T // 2 + 4] = tok.mask_id
    valid = torch.ones(2, T, dtype=torch.bool)
    valid[1, T - 5:] = False
    ids[~valid] = tok.pad_id
    return ids, valid


def _ours(model, ids: torch.Tensor, valid: torch.Tensor | None, causal: bool = False) -> torch.Tensor:
    B, T = ids.shape
    keys = torch.ones(B, T, dtype=torch.bool) if valid is None else valid
    mask = keys[:, None, :].expand(B, T, T)
    if causal:
        mask = mask & torch.ones(T, T, dtype=torch.bool).tril()
    with torch.no_grad():
        return model.lm_head(forward_hidden(model, ids, torch.arange(T), mask))


def _load_ours(remote, tok, tmp_path_factory, name: str):
    folder = tmp_path_factory.mktemp(name) / "ckpt"
    remote.save_pretrained(folder)
    tok.save(folder / "tokenizer.json")
    ours, _, cfg = families.load_checkpoint(folder)
    return ours.eval(), cfg


# ---- LLaDA -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llada(tmp_path_factory):
    modeling = _import_modeling(LLADA_DIR, "_llada_remote_code", "modeling_llada")
    tok = DiceTokenizer.load()
    cfg = modeling.LLaDAConfig(  # LLaDA-8B's options (config.json), tiny shape
        d_model=SHAPE["hidden_size"], n_heads=SHAPE["heads"], n_kv_heads=SHAPE["kv_heads"], n_layers=SHAPE["layers"],
        mlp_hidden_size=SHAPE["intermediate_size"], activation_type="silu", block_type="llama", rope=True,
        rope_theta=500000.0, layer_norm_type="rms", rms_norm_eps=1e-5, weight_tying=False, include_bias=False,
        include_qkv_bias=False, attention_dropout=0.0, residual_dropout=0.0, embedding_dropout=0.0,
        max_sequence_length=256, vocab_size=tok.vocab_size, embedding_size=tok.vocab_size, flash_attention=False,
        alibi=False, scale_logits=False, input_emb_norm=False, init_device="cpu",
        eos_token_id=tok.eos_id, pad_token_id=tok.pad_id, mask_token_id=tok.mask_id,
    )
    torch.manual_seed(0)
    return _pair(modeling.LLaDAModelLM(cfg, init_params=True).float().eval(), tok, tmp_path_factory, "llada", 500000.0)


def _llada_remote(remote, ids: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    # The inner LLaDAModel: LLaDAModelLM.forward only wraps its logits in an output class whose constructor
    # transformers >= 5 rejects (a renamed cache field); no math is skipped.
    with torch.no_grad():
        return remote.model(input_ids=ids, attention_mask=None if valid is None else valid.long()).logits


# ---- Dream -------------------------------------------------------------------------------------------------


def _default_rope(config, device=None, seq_len=None, **_):
    """transformers 4's ``_compute_default_rope_parameters`` (plain RoPE: ``1 / theta^(2i/d)``, scale 1), which
    transformers >= 5 no longer lists as ``ROPE_INIT_FUNCTIONS["default"]``; Dream's rotary class looks it up."""
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    exps = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
    return 1.0 / (config.rope_theta ** exps), 1.0


@pytest.fixture(scope="module")
def dream(tmp_path_factory):
    modeling = _import_modeling(DREAM_DIR, "_dream_remote_code", "modeling_dream")
    conf = importlib.import_module("_dream_remote_code.configuration_dream")
    # Library shims, not Dream's math: the module's own copy of the RoPE table gains transformers 4's "default"
    # entry (transformers' table is untouched), and the tied-weight list becomes transformers 5's {target: source}
    # (save_pretrained crashes on the list; the tensors saved are the same).
    if "default" not in modeling.ROPE_INIT_FUNCTIONS:
        modeling.ROPE_INIT_FUNCTIONS = {**modeling.ROPE_INIT_FUNCTIONS, "default": _default_rope}
    if isinstance(getattr(modeling.DreamModel, "_tied_weights_keys", None), list):
        modeling.DreamModel._tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    tok = DiceTokenizer.load()
    cfg = conf.DreamConfig(
        vocab_size=tok.vocab_size, hidden_size=SHAPE["hidden_size"], intermediate_size=SHAPE["intermediate_size"],
        num_hidden_layers=SHAPE["layers"], num_attention_heads=SHAPE["heads"], num_key_value_heads=SHAPE["kv_heads"],
        max_position_embeddings=256, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        mask_token_id=tok.mask_id, pad_token_id=tok.pad_id, eos_token_id=tok.eos_id,
    )
    torch.manual_seed(0)
    return _pair(modeling.DreamModel(cfg).float().eval(), tok, tmp_path_factory, "dream", 1000000.0)


def _dream_remote(remote, ids: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    with torch.no_grad():
        return remote(input_ids=ids, attention_mask=None if valid is None else valid.long()).logits


# ---- both families ---------------------------------------------------------------------------------------

_REMOTE_CALL = {"llada": _llada_remote, "dream": _dream_remote}
_NEEDS = {"llada": needs_llada, "dream": needs_dream}


@pytest.fixture(params=[pytest.param(f, marks=_NEEDS[f]) for f in ("llada", "dream")])
def pair(request):
    """(remote logits of (ids, valid), our model, tokenizer) for each family whose remote code is present."""
    remote, ours, tok = request.getfixturevalue(request.param)
    return (lambda ids, valid: _REMOTE_CALL[request.param](remote, ids, valid)), ours, tok


def test_full_attention_same_logits(pair):
    remote, ours, tok = pair
    ids, _ = _batch(tok)
    want = remote(ids, None)
    diff = (want - _ours(ours, ids, None)).abs().max().item()
    assert diff <= TOL, f"max |logit difference| {diff:.3g} > {TOL}"
    bad = (want - _ours(ours, ids, None, causal=True)).abs().max().item()
    assert bad > 1e-2, f"a causal mask changed the logits by only {bad:.3g}"


def test_padded_batch_same_logits(pair):
    """Real positions must agree (Dream masks padded queries too: their rows are not compared)."""
    remote, ours, tok = pair
    ids, valid = _batch(tok)
    diff = (remote(ids, valid) - _ours(ours, ids, valid))[valid].abs().max().item()
    assert diff <= TOL, f"max |logit difference| {diff:.3g} > {TOL}"
