"""Model families of the diffusion policy on transformers-native classes: SDAR, LLaDA, Dream.

==========  =====================  =========================  ==========================================
family      transformers class     attention                  logits / checkpoint names
==========  =====================  =========================  ==========================================
``sdar``    ``Qwen3ForCausalLM``   block-causal (model.py)    no shift; Qwen3's names (SDAR, TraDo, DICE)
``llada``   ``LlamaForCausalLM``   full (bidirectional)       no shift; LLaDA's OLMo-style names, renamed
``dream``   ``Qwen2ForCausalLM``   full (bidirectional)       SHIFTED: logits at ``i`` predict token ``i+1``
==========  =====================  =========================  ==========================================

* SDAR / TraDo / DICE (block diffusion, JetAstra/SDAR; DICE's released checkpoints) are Qwen3 with a
  block-causal mask: the same parameter names as ``Qwen3ForCausalLM``.
* LLaDA (Nie et al. 2025, arXiv 2502.09992, ``GSAI-ML/LLaDA-8B-*``) is a Llama-shaped masked-diffusion model
  without a causal mask; its remote code (OLMo-derived ``modeling_llada.py``) names the weights
  ``model.transformer.{wte, blocks.i.{attn_norm, q_proj, k_proj, v_proj, attn_out, ff_norm, ff_proj, up_proj,
  ff_out}, ln_f, ff_out}``, with the MLP ``ff_out(silu(ff_proj(x)) * up_proj(x))``, RMSNorm, half-split RoPE
  and ``head_dim = d_model / n_heads``: exactly ``LlamaForCausalLM`` under other names (:data:`LLADA_TO_LLAMA`).
* Dream (Ye et al. 2025, ``Dream-org/Dream-v0-*-7B``, also DiffuCoder) is Qwen2.5 trained as a diffusion model
  with full attention and keeps the AR logit alignment: its sampler shifts the logits right by one
  (``cat([logits[:, :1], logits[:, :-1]])``), so a masked token at position ``i`` is read from the logits at
  ``i - 1`` (:func:`logit_shift`). Its weights use Qwen2's names.

The checkpoints of LLaDA and Dream ship remote code; here they load into the transformers classes above with the
project's explicit-mask attention (``"dice_block"``, :mod:`dice_ray.policy.model`): no ``trust_remote_code``,
no download. :func:`load_checkpoint` reads a folder (``config.json`` + ``*.safetensors`` + ``tokenizer.json``);
:func:`save_checkpoint` writes one in the family's own format (the inverse renaming for LLaDA).

Sampling, infilling, the RL log-prob estimators (:mod:`dice_ray.policy.logprobs`) and SFT (:mod:`dice_ray.policy.sft_loss`)
support every family: SDAR in the block-diffusion ``x_t ‖ x_0`` layout, LLaDA / Dream with full attention over prompt
and response, Dream's logits read one position left.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.initialization import no_init_weights

from dice_ray.config import ModelConfig
from dice_ray.policy import model as block_model
from dice_ray.policy.tokenizer import DiceTokenizer

FAMILIES: tuple[str, ...] = ("sdar", "llada", "dream")
_CLASSES = {"sdar": (Qwen3Config, Qwen3ForCausalLM), "llada": (LlamaConfig, LlamaForCausalLM),
            "dream": (Qwen2Config, Qwen2ForCausalLM)}
_MODEL_TYPES = {"sdar": "sdar", "llada": "llada", "dream": "Dream"}
_ARCHITECTURES = {"sdar": "SDARForCausalLM", "llada": "LLaDAModelLM", "dream": "DreamModel"}
_FAMILY_OF_MODEL_TYPE = {"sdar": "sdar", "qwen3": "sdar", "llada": "llada", "dream": "dream", "llama": "llada",
                         "qwen2": "dream"}
_MASK_TOKENS = ("<|MASK|>", "<MASK>", "<|mask|>", "<|mdm_mask|>")
_NOT_CONFIG_KEYS = ("model_type", "architectures", "auto_map", "transformers_version", "_name_or_path")

LLADA_TO_LLAMA: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "attn_out": "self_attn.o_proj",
    "ff_norm": "post_attention_layernorm",
    "ff_proj": "mlp.gate_proj",  # LLaDA: ff_out(act(ff_proj(x)) * up_proj(x)); the activation is on ff_proj
    "up_proj": "mlp.up_proj",
    "ff_out": "mlp.down_proj",
}
"""LLaDA block module name -> ``LlamaDecoderLayer`` module name (``model.transformer.blocks.i.*`` ->
``model.layers.i.*``); top level: ``wte`` -> ``model.embed_tokens``, ``ln_f`` -> ``model.norm``,
``ff_out`` -> ``lm_head``."""
_LLADA_TOP = {"model.transformer.wte.weight": "model.embed_tokens.weight",
              "model.transformer.ln_f.weight": "model.norm.weight",
              "model.transformer.ff_out.weight": "lm_head.weight"}
_LLADA_BLOCK = re.compile(r"model\.transformer\.blocks\.(\d+)\.(\w+)\.weight")
_LLAMA_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.weight")


def logit_shift(family: str) -> int:
    """How far the logits are shifted: the token at position ``i`` is predicted at ``i - logit_shift(family)``.

    0 for SDAR and LLaDA (a masked position predicts itself), 1 for Dream (AR-style alignment).

    Raises:
        ValueError: unknown ``family``.
    """
    if family not in FAMILIES:
        raise ValueError(f"family: must be one of {FAMILIES}, got {family!r}")
    return 1 if family == "dream" else 0


def family_of(model: torch.nn.Module) -> str | None:
    """The family of a built model from its transformers ``config.model_type`` (None if unknown).

    Unwraps a ``.module`` attribute (DeepSpeed engines).
    """
    model = getattr(model, "module", model)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return _FAMILY_OF_MODEL_TYPE.get(str(model_type).lower()) if model_type else None


def _instantiate(hf_config, family: str, dtype: str, empty: bool = False) -> torch.nn.Module:
    """The transformers model of ``family`` from ``hf_config`` with the ``dice_block`` attention, in ``dtype``.

    ``empty``: skip the random initialisation and allocate directly in ``dtype`` (every weight is loaded next;
    an 8B checkpoint would otherwise be initialised in fp32 first).
    """
    if family != "sdar":
        hf_config.is_causal = False  # bidirectional families: never a causal mask, even a default one
    hf_config._attn_implementation = block_model.ATTN_IMPL
    cls, torch_dtype = _CLASSES[family][1], getattr(torch, dtype)
    if not empty:
        return block_model.use_torch_rms_norm(cls(hf_config)).to(torch_dtype)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    try:
        with no_init_weights():
            model = cls(hf_config)
    finally:
        torch.set_default_dtype(default)
    model.tie_weights()  # no_init_weights skips the tying too
    return block_model.use_torch_rms_norm(model).to(torch_dtype)


def build_model(cfg: ModelConfig, vocab_size: int, pad_id: int) -> torch.nn.Module:
    """A randomly initialised model of family ``cfg.family`` and shape ``cfg`` (no download).

    SDAR: :func:`dice_ray.policy.model.build_model` (Qwen3). LLaDA: ``LlamaForCausalLM`` (RMSNorm eps 1e-5,
    no biases, LLaDA's). Dream: ``Qwen2ForCausalLM`` (q/k/v biases, RMSNorm eps 1e-6, Qwen2's).

    Raises:
        ValueError: ``num_attention_heads`` is not a multiple of ``num_key_value_heads``, or (LLaDA / Dream,
            whose code derives the head width) ``num_attention_heads * head_dim != hidden_size``.
    """
    if cfg.family == "sdar":
        return block_model.build_model(cfg, vocab_size, pad_id)
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ValueError(
            f"num_attention_heads={cfg.num_attention_heads} must be a multiple of "
            f"num_key_value_heads={cfg.num_key_value_heads}"
        )
    if cfg.num_attention_heads * cfg.head_dim != cfg.hidden_size:
        raise ValueError(
            f"model.family={cfg.family!r}: num_attention_heads * head_dim ({cfg.num_attention_heads} * "
            f"{cfg.head_dim}) must equal hidden_size={cfg.hidden_size} (LLaDA and Dream derive head_dim from it)"
        )
    common = {
        "vocab_size": vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_word_embeddings, "pad_token_id": pad_id,
        "attention_dropout": 0.0,
    }
    if cfg.family == "llada":
        hf = LlamaConfig(**common, rms_norm_eps=1e-5, attention_bias=False, mlp_bias=False)
    else:
        hf = Qwen2Config(**common, rms_norm_eps=1e-6, use_sliding_window=False)
    return _instantiate(hf, cfg.family, cfg.dtype)


# ---- checkpoint folders ------------------------------------------------------------------------------------


class FolderTokenizer(DiceTokenizer):
    """The ``tokenizer.json`` of a checkpoint folder with the special ids its config names (DiceTokenizer's
    interface; the ids come from the folder, not from dice-ray's own special-token spellings).

    Attributes:
        pad_id, mask_id, eos_id: ids of padding, the diffusion mask token and end of sequence.
        vocab_size: number of tokenizer ids (the model's embedding may be larger, e.g. LLaDA's 126464).
    """

    def __init__(self, tok: Tokenizer, pad_id: int, mask_id: int, eos_id: int):
        self._tok = tok
        self.pad_id, self.mask_id, self.eos_id = pad_id, mask_id, eos_id
        self.vocab_size: int = tok.get_vocab_size()


def is_checkpoint_folder(path: str | Path) -> bool:
    """True when ``path`` holds a transformers-style ``config.json`` (an SDAR / LLaDA / Dream checkpoint)."""
    return (Path(path) / "config.json").is_file()


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?")
_HUB_FILES = ["config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
              "generation_config.json"]


def resolve_checkpoint(path: str | Path) -> Path:
    """The local folder of a checkpoint named by a path or a Hugging Face Hub id (``org/name`` or
    ``org/name@revision``, e.g. ``GSAI-ML/LLaDA-8B-Instruct``).

    An existing local path is returned as it is; ``org/name`` where ``org`` is a folder here is a local path
    (``runs/typo`` is a mistyped run, not a download).  A hub id is looked up in the local hub cache first
    (``HF_HUB_CACHE`` / ``HF_HOME``; no network), then downloaded with ``huggingface_hub.snapshot_download``
    (only ``config.json``, the safetensors and the tokenizer files: the remote code is neither fetched nor run),
    unless ``HF_HUB_OFFLINE`` is set.

    Raises:
        FileNotFoundError: ``path`` is neither an existing path nor a hub id (or is a missing local one), or the
            hub id is not in the cache and cannot be downloaded (offline, no network, unknown repository); the
            message names the id.
    """
    local = Path(path)
    text = str(path)
    if not local.exists() and _HUB_ID.fullmatch(text) and local.parent.is_dir():
        # runs/nope: a folder of that name would be local (a mistyped run), not a download of org "runs"
        raise FileNotFoundError(f"model path {text!r}: no such folder in {str(local.parent)!r} (taken as a local "
                                f"path since {str(local.parent)!r} is a folder here, not as a hub id)")
    if local.exists() or not _HUB_ID.fullmatch(text):
        if not local.exists():
            raise FileNotFoundError(f"model path {text!r}: no such folder, and not a hub id (org/name[@revision])")
        return local
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo, _, revision = text.partition("@")
    try:
        return Path(snapshot_download(repo, revision=revision or None, allow_patterns=_HUB_FILES,
                                      local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise FileNotFoundError(f"model path {text!r}: no local folder of that name; as a hub id it is not in the "
                                f"local hub cache, and HF_HUB_OFFLINE is set")
    try:
        return Path(snapshot_download(repo, revision=revision or None, allow_patterns=_HUB_FILES))
    except Exception as e:  # noqa: BLE001 - network, auth, unknown repo: one clear error naming the id
        raise FileNotFoundError(f"model path {text!r}: no local folder of that name; as a hub id it is not in the "
                                f"local hub cache and the download failed ({type(e).__name__}: {e})") from None


def _first_id(value) -> int | None:
    """An id from a config entry that may be an int, a list of ints (first taken) or None."""
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def _special_ids(raw: dict, tok: Tokenizer, folder: Path) -> tuple[int, int, int]:
    """(pad, mask, eos) ids: ``config.json``'s ``*_token_id`` entries, else the tokenizer's mask token names."""
    mask_id = _first_id(raw.get("mask_token_id"))
    if mask_id is None:
        found = [tok.token_to_id(t) for t in _MASK_TOKENS if tok.token_to_id(t) is not None]
        if not found:
            raise ValueError(
                f"checkpoint {folder}: no mask token: config.json has no mask_token_id and tokenizer.json has none "
                f"of {_MASK_TOKENS}"
            )
        mask_id = found[0]
    eos_id = _first_id(raw.get("eos_token_id"))
    if eos_id is None:
        raise ValueError(f"checkpoint {folder}: config.json must give eos_token_id")
    pad_id = _first_id(raw.get("pad_token_id"))
    return (eos_id if pad_id is None else pad_id), mask_id, eos_id


def _llada_to_llama_config(raw: dict, folder: Path) -> LlamaConfig:
    """``LlamaConfig`` equal to a LLaDA ``config.json``; refuses LLaDA options Llama cannot express."""
    unsupported = {
        "include_bias": True, "include_qkv_bias": True, "attention_layer_norm": True, "scale_logits": True,
        "input_emb_norm": True, "alibi": True, "rope": False, "multi_query_attention": True,
    }
    bad = [k for k, v in unsupported.items() if k in raw and raw[k] == v]
    for key, want in (("block_type", "llama"), ("layer_norm_type", "rms"), ("activation_type", "silu")):
        if key in raw and raw[key] != want:
            bad.append(f"{key}={raw[key]!r} (needs {want!r})")
    if bad:
        raise ValueError(f"checkpoint {folder}: LLaDA options without a Llama equivalent: {bad}")
    d_model, n_heads = raw["d_model"], raw["n_heads"]
    mlp = raw.get("mlp_hidden_size") or raw.get("mlp_ratio", 4) * d_model
    return LlamaConfig(
        vocab_size=raw.get("embedding_size") or raw["vocab_size"], hidden_size=d_model, intermediate_size=mlp,
        num_hidden_layers=raw["n_layers"], num_attention_heads=n_heads,
        num_key_value_heads=raw.get("n_kv_heads") or n_heads, head_dim=d_model // n_heads,
        max_position_embeddings=raw.get("max_sequence_length", 4096), rope_theta=raw.get("rope_theta", 10000.0),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-5), tie_word_embeddings=bool(raw.get("weight_tying", False)),
        attention_bias=False, mlp_bias=False, attention_dropout=0.0,
    )


def llada_to_llama_name(name: str) -> str:
    """The ``LlamaForCausalLM`` parameter name of a LLaDA checkpoint tensor name.

    Raises:
        ValueError: ``name`` is not a LLaDA parameter this mapping knows.
    """
    if name in _LLADA_TOP:
        return _LLADA_TOP[name]
    m = _LLADA_BLOCK.fullmatch(name)
    if m is None or m.group(2) not in LLADA_TO_LLAMA:
        raise ValueError(f"LLaDA checkpoint tensor {name!r}: unknown name (known: {sorted(LLADA_TO_LLAMA)})")
    return f"model.layers.{m.group(1)}.{LLADA_TO_LLAMA[m.group(2)]}.weight"


def llama_to_llada_name(name: str) -> str:
    """The LLaDA checkpoint name of a ``LlamaForCausalLM`` parameter (inverse of :func:`llada_to_llama_name`)."""
    top = {v: k for k, v in _LLADA_TOP.items()}
    if name in top:
        return top[name]
    inverse = {v: k for k, v in LLADA_TO_LLAMA.items()}
    m = _LLAMA_LAYER.fullmatch(name)
    if m is None or m.group(2) not in inverse:
        raise ValueError(f"Llama parameter {name!r} has no LLaDA name")
    return f"model.transformer.blocks.{m.group(1)}.{inverse[m.group(2)]}.weight"


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's ``*.safetensors`` files (one file or shards)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"checkpoint {folder}: no *.safetensors file")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def check_checkpoint_folder(folder: Path, model_cfg: ModelConfig | None = None) -> tuple[dict, str]:
    """Check a checkpoint folder the way :func:`load_checkpoint` needs it, without reading its weights (a driver
    checks ``model.path`` with this before any actor starts).  Every problem found is in the one error.

    Returns:
        (``config.json`` as a dict, the family it describes).

    Raises:
        FileNotFoundError: no ``config.json``, ``tokenizer.json`` or ``*.safetensors`` file (the message also
            names what is wrong with a ``config.json`` that is there).
        ValueError: ``config.json`` is not a JSON object, its ``model_type`` is not a known family's, or the
            family is not ``model_cfg.family``.
    """
    missing = [f for f in ("config.json", "tokenizer.json") if not (folder / f).is_file()]
    if not any(folder.glob("*.safetensors")):
        missing.append("*.safetensors")
    problems = [f"missing {', '.join(missing)}"] if missing else []
    raw: dict = {}
    family = ""
    if (folder / "config.json").is_file():
        parsed = None
        try:
            parsed = json.loads((folder / "config.json").read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            problems.append(f"config.json is not valid JSON ({e})")
        if parsed is not None and not isinstance(parsed, dict):
            problems.append(f"config.json holds a {type(parsed).__name__}, not a JSON object")
        elif isinstance(parsed, dict):
            raw = parsed
            family = _FAMILY_OF_MODEL_TYPE.get(str(raw.get("model_type", "")).lower(), "")
            if not family:
                problems.append(f"config.json model_type {raw.get('model_type')!r} is not one of "
                                f"{sorted(set(_FAMILY_OF_MODEL_TYPE))} (SDAR / Qwen3, LLaDA, Dream / Qwen2)")
            elif model_cfg is not None and model_cfg.family != family:
                problems.append(f"model.family={model_cfg.family!r} but it holds a {family!r} model (config.json "
                                f"model_type {raw.get('model_type')!r}): set model.family={family}")
    if problems:
        raise (FileNotFoundError if missing else ValueError)(f"checkpoint {folder}: {'; '.join(problems)}")
    return raw, family


def load_checkpoint(path: str | Path, model_cfg: ModelConfig | None = None):
    """Load an SDAR / LLaDA / Dream checkpoint folder into its transformers-native class (no remote code).

    The folder holds ``config.json`` (the family's own format: Qwen3 / SDAR, LLaDA or Dream keys; the family is
    read from ``model_type``), ``*.safetensors`` (one file or shards) and ``tokenizer.json``. Special ids come
    from ``config.json`` (``mask_token_id``, ``eos_token_id``, ``pad_token_id``; pad defaults to eos); without a
    ``mask_token_id`` the tokenizer's ``<|MASK|>`` / ``<MASK>`` / ``<|mask|>`` / ``<|mdm_mask|>`` is used.

    Args:
        path: the folder.
        model_cfg: the run's model section; its ``family`` must match the folder's, its ``block_size`` and
            ``dtype`` apply (the shape comes from ``config.json``). None: family from the folder, defaults.

    Returns:
        (model, :class:`FolderTokenizer`, :class:`ModelConfig` describing the loaded model, ``path`` set).

    Raises:
        FileNotFoundError, ValueError: what :func:`check_checkpoint_folder` refuses.
        ValueError: LLaDA options Llama cannot express, unknown or missing tensors, or no mask token.
    """
    folder = Path(path)
    raw, family = check_checkpoint_folder(folder, model_cfg)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    pad_id, mask_id, eos_id = _special_ids(raw, tok, folder)
    if family == "llada":
        hf = _llada_to_llama_config(raw, folder)
    else:
        cls = _CLASSES[family][0]
        hf = cls(**{k: v for k, v in raw.items() if k not in _NOT_CONFIG_KEYS})
    dtype = model_cfg.dtype if model_cfg is not None else "float32"
    model = _instantiate(hf, family, dtype, empty=True)
    weights = _read_weights(folder)
    if family == "llada":
        weights = {llada_to_llama_name(k): v for k, v in weights.items()}
    if hf.tie_word_embeddings and "model.embed_tokens.weight" in weights:  # tied checkpoints store it once
        weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
    result = model.load_state_dict(weights, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(
            f"checkpoint {folder}: tensors do not match a {family} model: missing {result.missing_keys[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}"
        )
    base = model_cfg if model_cfg is not None else ModelConfig(family=family)
    cfg = ModelConfig.model_validate({
        **base.model_dump(),
        "hidden_size": hf.hidden_size, "intermediate_size": hf.intermediate_size,
        "num_hidden_layers": hf.num_hidden_layers, "num_attention_heads": hf.num_attention_heads,
        "num_key_value_heads": hf.num_key_value_heads,
        "head_dim": getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        "max_position_embeddings": hf.max_position_embeddings,
        "rope_theta": float(hf.rope_parameters["rope_theta"]), "tie_word_embeddings": bool(hf.tie_word_embeddings),
        "path": str(folder), "family": family,
    })
    return model, FolderTokenizer(tok, pad_id, mask_id, eos_id), cfg


def save_checkpoint(model: torch.nn.Module, tokenizer, family: str, path: str | Path) -> None:
    """Write ``model`` as a checkpoint folder of ``family``'s own format (inverse of :func:`load_checkpoint`).

    ``config.json`` (SDAR: Qwen3 keys, ``model_type`` ``"sdar"``; LLaDA: LLaDA's OLMo-style keys; Dream: Qwen2
    keys, ``model_type`` ``"Dream"``) with the tokenizer's ``mask_token_id`` / ``eos_token_id`` /
    ``pad_token_id``, ``model.safetensors`` (LLaDA: LLaDA's tensor names) and ``tokenizer.json``.

    Raises:
        ValueError: unknown ``family``.
    """
    logit_shift(family)  # validates the family
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    hf = model.config
    ids = {"mask_token_id": tokenizer.mask_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
    state: dict[str, torch.Tensor] = {}
    seen: set[tuple] = set()
    for name, t in model.state_dict().items():
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:  # a tied tensor (lm_head = embed_tokens): kept once, as the checkpoints do
            continue
        seen.add(key)
        state[llama_to_llada_name(name) if family == "llada" else name] = t.detach().to("cpu", copy=True).contiguous()
    if family == "llada":
        raw = {
            "d_model": hf.hidden_size, "n_heads": hf.num_attention_heads, "n_kv_heads": hf.num_key_value_heads,
            "n_layers": hf.num_hidden_layers, "mlp_hidden_size": hf.intermediate_size, "vocab_size": hf.vocab_size,
            "embedding_size": hf.vocab_size, "max_sequence_length": hf.max_position_embeddings,
            "rope_theta": hf.rope_parameters["rope_theta"], "rms_norm_eps": hf.rms_norm_eps,
            "weight_tying": bool(hf.tie_word_embeddings), "include_bias": False, "include_qkv_bias": False,
            "activation_type": "silu", "block_type": "llama", "layer_norm_type": "rms",
            "attention_layer_norm": False, "rope": True, "alibi": False, "scale_logits": False,
            "input_emb_norm": False,
        }
    else:
        raw = {k: v for k, v in hf.to_dict().items() if k not in _NOT_CONFIG_KEYS and k != "is_causal"}
    raw.update(ids, model_type=_MODEL_TYPES[family], architectures=[_ARCHITECTURES[family]])
    (folder / "config.json").write_text(json.dumps(raw, indent=2, default=str))
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(folder / "tokenizer.json")
