"""The tiny SDAR-shape block-diffusion LM: transformers' ``Qwen3ForCausalLM`` with block-causal attention.

Sequence layout (used by SFT, sampling and the TraceRL trainer alike):

* the prompt is split in blocks of ``block_size`` tokens aligned to its END (:func:`prompt_blocks`: blocks
  ``..., -1, 0``, the first one possibly shorter), as if it were left-padded to a multiple of the block
  length: SDAR's own generation mask (and its training partition from position 0 when the prompt length is
  a multiple of the block length). Remote-code comparison: ``tests/test_policy_sdar_remote.py``;
* the response is split in blocks of ``block_size`` tokens (blocks 1, 2, ...); a query in block ``b``
  attends the keys of blocks ``<= b`` (bidirectional within a block, causal across blocks), prompt and
  response alike;
* logits at a masked position predict the token AT that position (no shift, as in SDAR / LLaDA).

Training passes use BD3-LM's / SDAR's ``x_t ‖ x_0`` layout: the clean response ``x_0`` (copy 0) and one or
more noisy copies ``x_t`` (copy >= 1) of it, with the same position ids. A clean query of block ``b`` sees
clean keys of blocks ``<= b``; a noisy query of block ``b`` (copy ``c``) sees clean keys of blocks ``< b``
and the noisy keys of its own block and copy. :func:`block_mask` is that one rule; the sampler uses it too
(its current block is a noisy copy, its KV cache holds the clean blocks), so what the sampler sees is what
the trainer sees.

The attention runs through a registered transformers attention function (``"dice_block"``) that takes
the explicit boolean mask, applies a :class:`KVCache` when one is passed (``block_kv=``) and calls
``torch.nn.functional.scaled_dot_product_attention``. Calling the model without an explicit mask raises,
so a plain causal pass can never slip in by accident.

Two attention implementations serve that mask (:func:`set_attention`, the learner's ``cluster.learner_attention``):

* ``sdpa`` (default): SDPA over the dense boolean mask; every query-key pair is computed, the masked ones
  thrown away (about half of a training pass's pairs in the ``x_t ‖ x_0`` layout);
* ``flex``: FlexAttention (``torch.nn.attention.flex_attention``) with a ``BlockMask`` built from the SAME
  dense mask (:func:`flex_block_mask`: its ``mask_mod`` reads the dense mask, and its tile tables are that
  mask reduced over 128 x 128 tiles), so fully masked tiles are skipped and partial ones masked exactly as
  SDPA masks them. :func:`block_mask` stays the one place the rule is written; both paths consume its
  output. Used for training passes (no cache, or a concatenating :class:`KVCache`) and no-cache sampling
  passes; a preallocated (capacity) cache, the sampler's CUDA-graph path, keeps SDPA. On CUDA the kernel is
  ``torch.compile``'d FlexAttention; PyTorch has no FlexAttention backward on CPU, so CPU training keeps
  ``sdpa`` (``auto`` picks ``flex`` on CUDA only).
"""

from __future__ import annotations

import sys
from contextlib import nullcontext
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface, Qwen3Config, Qwen3ForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from dice_ray.config import ModelConfig

ATTN_IMPL = "dice_block"
#: SDPA kernels allowed in passes without autograd (sampling): the memory-efficient kernel (MATH where it cannot
#: run, e.g. on CPU). cuDNN's attention, PyTorch's first choice on an H100 / H200, spent ~1 ms of host time a
#: call building a plan for each new key length, and the decoder's grows every block (H200, SDAR-1.7B shape,
#: batch 64, before CUDA graphs: 28 ms of a 37-57 ms denoising step). On GPU time a decoding attention call
#: the two are close: memory-efficient 0.23 ms, cuDNN 0.21 ms. (FlashAttention takes no mask.)
NO_GRAD_SDPA = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class KVCache:
    """Keys and values of committed (clean) tokens, one entry per decoder layer.

    Tensors are ``[B, num_key_value_heads, L, head_dim]`` in the model dtype, after RoPE.

    Two ways to hold them:

    * ``capacity=None`` (training): each forward concatenates, and the tensors keep their autograd history,
      so a training pass can encode the prompt and clean response once and score several noisy copies
      against them (TraceRL's per-step passes). ``keep`` (set by :func:`forward_hidden`) decides what a forward
      stores: ``None`` all new tokens, ``n`` the first ``n``, ``0`` none (a read-only "peek").
    * ``capacity=C`` (sampling, no autograd): one zero-filled ``[B, Hkv, C, head_dim]`` buffer a layer,
      written in place. The caller sets :attr:`slots` (LongTensor[q] on the device: where the next forward's
      ``q`` new keys go, :meth:`next_slots`) and the forward attends the WHOLE buffer, so its mask is ``[q, C]``
      (:meth:`pad_mask` hides every position past ``len + q``); :meth:`commit` then adds the first ``n`` new
      tokens to the committed length. No Python int reaches a kernel, so one recorded forward replays at every
      cache length (the sampler's CUDA graphs, :mod:`dice_ray.policy.graphs`), and a step copies ``O(new
      tokens)`` instead of concatenating the whole cache at every layer (~11 GB a denoising step for the
      SDAR-1.7B shape at batch 64, L ~ 768). Positions past the committed length are scratch: a peek's keys
      there are overwritten by the next forward. Zero-filled, so the hidden positions hold finite values
      (masked scores become 0 weights, and 0 x NaN would still be NaN).
    """

    def __init__(self, capacity: int | None = None) -> None:
        """Raises ValueError: ``capacity`` < 1."""
        if capacity is not None and capacity < 1:
            raise ValueError(f"KVCache capacity={capacity}: must be >= 1 token (or None)")
        self.capacity = capacity
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.lengths: dict[int, int] = {}  # committed tokens of each layer (capacity=None)
        self.length = 0  # committed tokens (capacity=C)
        self.keep: int | None = None
        self.slots: torch.Tensor | None = None

    def __len__(self) -> int:
        """Committed length L (tokens)."""
        if self.capacity is not None:
            return self.length
        return next(iter(self.lengths.values()), 0)

    def next_slots(self, q: int, device: torch.device | str) -> torch.Tensor:
        """Point the next forward's ``q`` new keys at positions ``L .. L + q - 1`` (sets and returns :attr:`slots`).

        Raises:
            RuntimeError: ``L + q`` exceeds the capacity (or the cache has none).
        """
        if self.capacity is None or self.length + q > self.capacity:
            raise RuntimeError(f"KVCache capacity {self.capacity} exceeded: {self.length} committed + {q} new tokens")
        self.slots = torch.arange(self.length, self.length + q, device=device)
        return self.slots

    def pad_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """BoolTensor[..., q, L + q] (committed ‖ new keys, :func:`block_mask`) -> [..., q, C], False past ``L + q``."""
        out = mask.new_zeros(*mask.shape[:-1], self.capacity)
        out[..., : mask.shape[-1]] = mask
        return out

    def commit(self, n: int) -> None:
        """Add the first ``n`` new tokens of the last forward to the committed length (capacity mode)."""
        self.length += n

    def update(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values the forward attends for ``layer``: committed ‖ new (``capacity=None``: the part selected
        by ``keep`` is stored), or the whole buffer with the new ones written at :attr:`slots` (``capacity=C``).

        Raises:
            RuntimeError: a preallocated cache written with autograd on (its in-place writes would corrupt the
                graph), or without :attr:`slots` for the new tokens.
        """
        q = key.shape[-2]
        if self.capacity is None:
            L = self.lengths.get(layer, 0)
            keep = q if self.keep is None else self.keep
            if layer in self.keys:
                k_all = torch.cat([self.keys[layer], key], dim=-2)
                v_all = torch.cat([self.values[layer], value], dim=-2)
            else:
                k_all, v_all = key, value
            if keep > 0:
                self.keys[layer], self.values[layer] = k_all[..., : L + keep, :], v_all[..., : L + keep, :]
                self.lengths[layer] = L + keep
            return k_all, v_all
        if torch.is_grad_enabled():
            raise RuntimeError("a preallocated KVCache (capacity set) is for sampling: run under torch.no_grad()")
        if self.slots is None or self.slots.numel() != q:
            raise RuntimeError(f"KVCache: set slots for the {q} new tokens first (next_slots)")
        if layer not in self.keys:
            B, H, _, D = key.shape
            self.keys[layer] = key.new_zeros(B, H, self.capacity, D)
            self.values[layer] = value.new_zeros(B, H, self.capacity, D)
        self.keys[layer].index_copy_(2, self.slots, key)
        self.values[layer].index_copy_(2, self.slots, value)
        return self.keys[layer], self.values[layer]

    def expand(self, n: int) -> None:
        """Repeat each row of the cache ``n`` times: a batch-1 cache becomes ``n`` rows (views without a capacity;
        copies with one, which later forwards write into); a preallocated cache of ``B`` rows becomes ``B * n``, rows
        ``r * n .. r * n + n - 1`` copies of row ``r`` (the sampler's batch of groups: one prefilled prompt a group).

        Raises:
            ValueError: a batch above 1 without a capacity.
        """
        for d in (self.keys, self.values):
            for k in d:
                B = d[k].shape[0]
                if B != 1 and self.capacity is None:
                    raise ValueError(f"expand: cache batch is {B}, must be 1 (or the cache preallocated)")
                if B == 1:
                    d[k] = d[k].expand(n, -1, -1, -1)
                    if self.capacity is not None:
                        d[k] = d[k].contiguous()
                else:
                    d[k] = d[k].repeat_interleave(n, dim=0)


def _block_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: SDPA (or FlexAttention) with the explicit block mask and an optional KVCache.

    query ``[B, H, q, D]``, key/value ``[B, Hkv, q, D]``, attention_mask BoolTensor ``[1|B, 1, q, kv]``
    (True = attend); ``block_flex``: the :func:`flex_block_mask` of that mask (set by :func:`forward_hidden`
    when the model's attention is ``flex``). Returns ``([B, q, H, D], None)``.
    """
    if attention_mask is None or attention_mask.dtype != torch.bool:
        raise ValueError(
            "dice_block attention needs an explicit boolean block mask: call dice_ray.policy.model.forward_hidden"
        )
    cache: KVCache | None = kwargs.get("block_kv")
    if cache is not None:
        key, value = cache.update(module.layer_idx, key, value)
    check_attention_shapes(query, key, attention_mask, cache)
    return attend(query, key, value, attention_mask, kwargs.get("block_flex"), scaling,
                  dropout if module.training else 0.0), None


def check_attention_shapes(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor,
                           cache: KVCache | None = None) -> None:
    """Raise ValueError unless the mask ``[.., q, kv]`` matches the query length and the key length (after the cache)."""
    if attention_mask.shape[-1] != key.shape[-2] or attention_mask.shape[-2] != query.shape[-2]:
        raise ValueError(
            f"attention_mask {tuple(attention_mask.shape)} does not match query length {query.shape[-2]} "
            f"and key length {key.shape[-2]} (cache {len(cache) if cache is not None else 0})"
        )


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor,
           flex_mask=None, scaling: float | None = None, dropout: float = 0.0) -> torch.Tensor:
    """The attention itself: FlexAttention over ``flex_mask`` when one is given, else SDPA over the dense mask.

    query ``[B, H, q, D]``, key/value ``[B, Hkv, kv, D]`` (``H`` a multiple of ``Hkv``), attention_mask BoolTensor
    ``[1|B, 1, q, kv]``, flex_mask a ``BlockMask`` of that mask (:func:`flex_block_mask`) or None.
    Returns ``[B, q, H, D]`` (contiguous).
    """
    if flex_mask is not None and dropout == 0.0:
        out = _flex(query, key, value, flex_mask, scaling)
        if out is not None:
            return out.transpose(1, 2).contiguous()
    # GQA without copying keys: the ``rep`` query heads that share a KV head are stacked along the query
    # axis (head h = j * rep + r -> group j, rows r * q .. r * q + q - 1) and the mask's rows repeated to
    # match, so every fused SDPA kernel sees equal heads (they refuse enable_gqa with a mask) and the
    # keys and values -- the whole KV cache when sampling -- are read in place, not repeat_interleave'd.
    b, heads, q, d = query.shape
    rep = heads // key.shape[1]
    if rep > 1:
        query = query.reshape(b, key.shape[1], rep * q, d)
        attention_mask = attention_mask.repeat(1, 1, rep, 1)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling)
    return out.reshape(b, heads, q, d).transpose(1, 2).contiguous()


# ---- FlexAttention -------------------------------------------------------------------------------------------

ATTENTION_KINDS: tuple[str, ...] = ("sdpa", "flex", "auto")
#: tile of the BlockMask (query rows x key columns): FlexAttention's default; tests shrink it to see tiles skipped
FLEX_BLOCK = 128
_flex_state: dict = {"compiled": None, "broken": None, "memo": None}


def flex_blocker(model: torch.nn.Module | None = None, check_device: bool = True) -> str | None:
    """Why FlexAttention should not serve ``model``, in words, or None when it can.

    Checked: ``torch.nn.attention.flex_attention`` imports; no earlier FlexAttention call in this process failed to
    compile (:func:`flex_fallback_reason`); the head width is a power of two >= 16 (the Triton kernel's); the model
    has no attention dropout; with ``check_device``, the model is on CUDA (PyTorch has no FlexAttention backward on
    CPU, and without ``torch.compile`` it materialises every score there).
    """
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError as e:
        return f"torch {torch.__version__} has no FlexAttention ({e})"
    if _flex_state["broken"]:
        return f"FlexAttention failed earlier in this process: {_flex_state['broken']}"
    if model is None:
        return None
    model = getattr(model, "module", model)
    cfg = getattr(model, "config", None)
    if cfg is not None:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        if head_dim < 16 or head_dim & (head_dim - 1):
            return f"head_dim {head_dim} is not a power of two >= 16 (FlexAttention's kernel)"
        if getattr(cfg, "attention_dropout", 0.0):
            return f"attention_dropout {cfg.attention_dropout} (FlexAttention here takes none)"
    p = next(model.parameters(), None)
    if check_device and (p is None or p.device.type != "cuda"):
        device = p.device.type if p is not None else "cpu"
        return f"the model is on {device}: PyTorch's FlexAttention has no backward there"
    return None


def set_attention(model: torch.nn.Module, kind: str) -> str:
    """Choose the attention implementation of ``model``'s block-masked passes (see the module docstring); returns it.

    Args:
        model: a policy model built with ``dice_block`` attention (a DeepSpeed engine's ``.module`` is unwrapped).
        kind: ``"sdpa"`` (today's path), ``"flex"`` (FlexAttention; on CPU only for passes without autograd, which
            PyTorch's FlexAttention supports there) or ``"auto"`` (``flex`` when :func:`flex_blocker` finds nothing
            in the way, i.e. on CUDA, else ``sdpa``).

    Returns:
        ``"sdpa"`` or ``"flex"``, stored on the model (``model.dice_attention``, read by :func:`forward_hidden`;
        copied with the model by ``copy.deepcopy``).

    Raises:
        ValueError: an unknown ``kind``, or ``"flex"`` where FlexAttention does not import, the head width does not
            suit it or the model has attention dropout.
    """
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"attention={kind!r}: must be one of {ATTENTION_KINDS}")
    model = getattr(model, "module", model)
    if kind == "auto":
        kind = "flex" if flex_blocker(model) is None else "sdpa"
    elif kind == "flex":
        blocker = flex_blocker(model, check_device=False)  # an explicit choice may run forward-only on CPU
        if blocker is not None:
            raise ValueError(f"attention='flex': {blocker}")
    model.dice_attention = kind
    return kind


def attention_of(model: torch.nn.Module) -> str:
    """The attention implementation :func:`forward_hidden` uses for ``model``: ``"sdpa"`` unless set otherwise."""
    return getattr(getattr(model, "module", model), "dice_attention", "sdpa")


def flex_fallback_reason() -> str | None:
    """Why FlexAttention was given up in this process (its first compile failed; SDPA serves since), or None."""
    return _flex_state["broken"]


def flex_block_mask(mask: torch.Tensor):
    """A FlexAttention ``BlockMask`` of the dense boolean mask ``mask`` ``[q, kv]`` or ``[B, q, kv]`` (a ``[1, q, kv]``
    one broadcasts over the batch).

    Its ``mask_mod`` reads ``mask`` itself (``mask[b, q, kv]``), so FlexAttention masks exactly the pairs SDPA
    masks; its tile tables (:data:`FLEX_BLOCK` square tiles) mark a tile empty when no pair of it is attended
    (skipped), full when every pair is (no ``mask_mod`` call), partial otherwise. The last mask converted is
    remembered (unless it is an inference tensor): the noisy passes of a TraceRL group share one mask object and so
    one conversion.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    memo = _flex_state["memo"]
    version = None if mask.is_inference() else mask._version  # inference tensors keep no version: not remembered
    if memo is not None and memo[0] is mask and version is not None and memo[1] == version and memo[2] == FLEX_BLOCK:
        return memo[3]
    dense = mask[0] if mask.dim() == 3 and mask.shape[0] == 1 else mask
    q, kv = dense.shape[-2:]
    batch = None if dense.dim() == 2 else dense.shape[0]
    out = create_block_mask(_dense_mask_mod(dense), batch, None, q, kv, device=dense.device, BLOCK_SIZE=FLEX_BLOCK)
    _flex_state["memo"] = (mask, version, FLEX_BLOCK, out) if version is not None else None
    return out


def _dense_mask_mod(mask: torch.Tensor) -> Callable:
    """FlexAttention ``mask_mod`` reading a dense boolean mask ``[q, kv]`` or ``[B, q, kv]`` (one code object for
    every mask, so a compiled FlexAttention takes a new mask without recompiling)."""
    if mask.dim() == 2:
        def mask_mod(b, h, q_idx, kv_idx):
            return mask[q_idx, kv_idx]
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return mask[b, q_idx, kv_idx]
    return mask_mod


def _compiled_flex_attention() -> Callable:
    """``torch.compile(flex_attention)``, made once a process (dynamic=None: one recompile with symbolic lengths
    when a second shape comes, then none: an RL step's prompt and response lengths vary)."""
    if _flex_state["compiled"] is None:
        from torch.nn.attention.flex_attention import flex_attention

        _flex_state["compiled"] = torch.compile(flex_attention, dynamic=None)
    return _flex_state["compiled"]


def _flex(query, key, value, flex_mask, scaling) -> torch.Tensor | None:
    """FlexAttention ``[B, H, q, D]``, or None when it cannot run (an earlier compile failure, or this call's: SDPA
    serves instead, told once on stderr). Compiled on CUDA (inside a ``torch.compile``'d region it is already
    traced); eager on CPU, where PyTorch runs it forward-only."""
    if _flex_state["broken"]:
        return None
    from torch.nn.attention.flex_attention import flex_attention

    compiled = query.is_cuda and not torch.compiler.is_compiling()
    fn = _compiled_flex_attention() if compiled else flex_attention
    try:
        return fn(query, key, value, block_mask=flex_mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - a compile failure: SDPA from now on, said once
        if not compiled:
            raise
        _flex_state["broken"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        print(f"dice-ray: FlexAttention failed to compile ({_flex_state['broken']}); attention falls back to SDPA "
              f"for the rest of this process", file=sys.stderr, flush=True)
        return None


AttentionInterface.register(ATTN_IMPL, _block_attention)


class RMSNorm(torch.nn.Module):
    """RMSNorm (Zhang & Sennrich 2019) through torch's own fused kernel, ``torch.nn.functional.rms_norm``.

    ``y = x * rsqrt(mean(x^2, -1) + eps) * weight`` for x ``[..., d]`` of any float dtype, computed in fp32 and
    rounded once to x's dtype; transformers' Qwen3 / Llama / Qwen2 RMSNorm rounds the normalised x to x's dtype
    before multiplying by the weight, so the two differ by at most one rounding (one bf16 ulp).  It is one
    kernel forward and one backward where transformers' module launches seven elementwise kernels; on an H200
    at ``[4096, 2048]`` bf16 (medians of 20 CUDA-event timings): forward 21 us against
    transformers' 132 us and Liger-Kernel's 92 us, forward + backward 254 / 790 / 804 us, and 12 us of host time
    a forward call against Liger's 72 us.

    Args:
        weight: the ``[d]`` Parameter of the module it replaces (kept: same name in the state dict).
        eps: that module's ``variance_epsilon``.
    """

    def __init__(self, weight: torch.nn.Parameter, eps: float):
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(hidden_states, self.weight.shape, self.weight, self.variance_epsilon)


_TRANSFORMERS_RMS_NORMS = (Qwen3RMSNorm, LlamaRMSNorm, Qwen2RMSNorm)


def replace_modules(model: torch.nn.Module, cls: type | tuple[type, ...],
                    make: Callable[[torch.nn.Module], torch.nn.Module]) -> int:
    """Replace every submodule of ``model`` that is a ``cls`` by ``make(old)``, in place; returns how many.
    ``make`` should reuse the old module's Parameters so the state dict keeps its names."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if isinstance(child, cls)]
    for parent, name, child in swaps:
        setattr(parent, name, make(child))
    return len(swaps)


def use_torch_rms_norm(model: torch.nn.Module) -> torch.nn.Module:
    """Replace every transformers Qwen3 / Llama / Qwen2 RMSNorm module of ``model`` by :class:`RMSNorm`, in
    place, around the same weight Parameter (state dict and checkpoints unchanged); returns ``model``.
    Every policy model of :mod:`dice_ray.policy.families` gets it when built or loaded."""
    replace_modules(model, _TRANSFORMERS_RMS_NORMS, lambda norm: RMSNorm(norm.weight, norm.variance_epsilon))
    return model


def build_model(cfg: ModelConfig, vocab_size: int, pad_id: int) -> Qwen3ForCausalLM:
    """A randomly initialised Qwen3ForCausalLM of shape ``cfg`` with the block-causal attention (no download).

    Raises:
        ValueError: ``num_attention_heads`` is not a multiple of ``num_key_value_heads``.
    """
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ValueError(
            f"num_attention_heads={cfg.num_attention_heads} must be a multiple of "
            f"num_key_value_heads={cfg.num_key_value_heads}"
        )
    hf = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_word_embeddings,
        pad_token_id=pad_id,
        use_sliding_window=False,
        attention_dropout=0.0,
    )
    hf._attn_implementation = ATTN_IMPL
    model = use_torch_rms_norm(Qwen3ForCausalLM(hf))
    return model.to(getattr(torch, cfg.dtype))


def block_mask(
    q_block: torch.Tensor, q_copy: torch.Tensor, k_block: torch.Tensor, k_copy: torch.Tensor
) -> torch.Tensor:
    """The block-diffusion attention rule (SDAR / BD3-LM ``x_t ‖ x_0``) as a boolean mask.

    Args:
        q_block, q_copy: LongTensor[q] block index (prompt <= 0: :func:`prompt_blocks`; response block j = j + 1) and copy
            (0 = clean / prompt, c >= 1 = noisy copy c) of each query.
        k_block, k_copy: LongTensor[kv], the same for each key.

    Returns:
        BoolTensor[q, kv], True where the query attends the key: clean query of block b -> clean keys of
        blocks <= b; noisy query of block b, copy c -> clean keys of blocks < b and keys of block b, copy c.
    """
    qb, qc = q_block[:, None], q_copy[:, None]
    kb, kc = k_block[None, :], k_copy[None, :]
    clean_q = qc == 0
    sees_clean = (kc == 0) & torch.where(clean_q, kb <= qb, kb < qb)
    sees_own = (~clean_q) & (kc == qc) & (kb == qb)
    return sees_clean | sees_own


def prompt_blocks(prompt_len: int | torch.Tensor, block_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Block index of each prompt token: blocks of ``block_size`` aligned to the prompt's end, the last
    one 0 and earlier ones negative (the first possibly shorter), so the response's blocks (1, 2, ...)
    start right after it. Under :func:`block_mask` the prompt is block-causal, as in SDAR.

    Args:
        prompt_len: the prompt length, or LongTensor[B] of the lengths of a batch of right-padded prompts.
        device: where to build the result (default: ``prompt_len``'s device, else CPU).

    Returns:
        LongTensor[prompt_len] (``-((prompt_len - 1 - i) // block_size)``), or for a batch LongTensor[B, max
        length] (padding positions get blocks >= 1: mask them out).
    """
    lengths = torch.as_tensor(prompt_len, device=device)
    i = torch.arange(int(lengths.max()), device=lengths.device)
    return -((lengths[..., None] - 1 - i) // block_size)


def response_blocks(prompt_len: int, response_len: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block index and position id of each response token.

    Returns:
        (LongTensor[R] block index, starting at 1; LongTensor[R] position ids ``prompt_len + i``).

    Raises:
        ValueError: ``response_len`` is not a multiple of ``block_size``.
    """
    if response_len % block_size:
        raise ValueError(f"response length {response_len} must be a multiple of block_size={block_size}")
    idx = torch.arange(response_len)
    return idx // block_size + 1, idx + prompt_len


def forward_hidden(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    mask: torch.Tensor,
    cache: KVCache | None = None,
    keep: int | None = None,
) -> torch.Tensor:
    """Final hidden states of a block-masked pass (apply ``model.lm_head`` to the positions you score).

    Works for every family of :mod:`dice_ray.policy.families` (Qwen3, Llama, Qwen2 built with ``dice_block``
    attention); the bidirectional families pass a full (padding-only) mask. The model's attention
    (:func:`set_attention`) serves the mask: SDPA, or FlexAttention over a ``BlockMask`` of it (not with a
    preallocated cache, whose passes keep SDPA).

    Args:
        input_ids: LongTensor[B, q].
        position_ids: LongTensor[q] or [B, q] (RoPE positions; the noisy copy repeats the clean ones).
        mask: BoolTensor[q, kv] or [B, q, kv], ``kv = len(cache) + q`` (see :func:`block_mask`), or the
            cache's capacity for a preallocated one (:meth:`KVCache.pad_mask`).
        cache: a :class:`KVCache` holding keys/values of earlier tokens, or None.
        keep: what a concatenating cache stores of this pass (see :class:`KVCache`); ignored without a cache
            and by a preallocated one (the caller commits).

    Returns:
        FloatTensor[B, q, hidden_size] in the model dtype.

    Raises:
        ValueError: the mask shape does not match the query / key lengths.
    """
    B, q = input_ids.shape
    if position_ids.dim() == 1:
        position_ids = position_ids[None].expand(B, -1)
    mask4 = mask[None, None] if mask.dim() == 2 else mask[:, None]
    kwargs = {}
    if cache is not None:
        cache.keep = keep
        kwargs["block_kv"] = cache
    if attention_of(model) == "flex" and (cache is None or cache.capacity is None) and not _flex_state["broken"]:
        kwargs["block_flex"] = flex_block_mask(mask)  # one conversion a pass, shared by every layer
    no_grad_cuda = input_ids.is_cuda and not torch.is_grad_enabled()
    with sdpa_kernel(NO_GRAD_SDPA) if no_grad_cuda else nullcontext():
        out = model.model(  # a 4-D mask goes through transformers' mask preparation untouched (Qwen3, Qwen2, Llama)
            input_ids=input_ids,
            attention_mask=mask4,
            position_ids=position_ids,
            use_cache=False,
            **kwargs,
        )
    return out.last_hidden_state


def token_logits(model: Qwen3ForCausalLM, hidden: torch.Tensor, mask_id: int) -> torch.Tensor:
    """The policy's logits: ``model.lm_head(hidden)`` in fp32 with ``<|mask|>`` excluded (-inf).

    The mask token is an input symbol only; the sampler, the TraceRL log-probs and SFT all use this one
    distribution, so behaviour and training log-probs share their support.

    Args:
        hidden: FloatTensor[..., hidden_size].

    Returns:
        FloatTensor[..., vocab_size] (fp32).
    """
    logits = model.lm_head(hidden).float()
    logits[..., mask_id] = float("-inf")
    return logits

