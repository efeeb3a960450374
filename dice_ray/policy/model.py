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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, Qwen3Config, Qwen3ForCausalLM

from dice_ray.config import ModelConfig

ATTN_IMPL = "dice_block"


class KVCache:
    """Keys and values of committed (clean) tokens, one entry per decoder layer.

    Tensors are ``[B, num_key_value_heads, L, head_dim]`` in the model dtype, after RoPE.

    ``keep`` decides what a forward stores: ``None`` all new tokens, ``n`` the first ``n`` new tokens,
    ``0`` none (a read-only "peek", e.g. one denoising step of the current block).

    Two ways to hold them:

    * ``capacity=None`` (training): each forward concatenates, and the tensors keep their autograd history,
      so a training pass can encode the prompt and clean response once and score several noisy copies
      against them (TraceRL's per-step passes).
    * ``capacity=C`` (sampling, no autograd): one ``[B, Hkv, C, head_dim]`` buffer a layer, written in place;
      a forward writes its new keys after the committed ones and attends to a view, so a step costs
      ``O(new tokens)`` of copying instead of ``O(L)`` (a concatenation copies the whole cache at every layer
      and step: ~11 GB a denoising step for the SDAR-1.7B shape at batch 64 and L ~ 768). Positions past the
      committed length are scratch: a peek's keys there are overwritten by the next forward.
    """

    def __init__(self, capacity: int | None = None) -> None:
        """Raises ValueError: ``capacity`` < 1."""
        if capacity is not None and capacity < 1:
            raise ValueError(f"KVCache capacity={capacity}: must be >= 1 token (or None)")
        self.capacity = capacity
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.lengths: dict[int, int] = {}  # committed tokens of each layer
        self.keep: int | None = None

    def __len__(self) -> int:
        """Committed length L (tokens)."""
        return next(iter(self.lengths.values()), 0)

    def update(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return committed ‖ new keys and values of ``layer``; store the part selected by ``keep``.

        Raises:
            RuntimeError: a preallocated cache would overflow its ``capacity``, or is written with autograd
                on (its in-place writes would corrupt the graph).
        """
        q = key.shape[-2]
        L = self.lengths.get(layer, 0)
        keep = q if self.keep is None else self.keep
        if self.capacity is None:
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
        if L + q > self.capacity:
            raise RuntimeError(f"KVCache capacity {self.capacity} exceeded: {L} committed + {q} new tokens")
        if layer not in self.keys:
            B, H, _, D = key.shape
            self.keys[layer] = key.new_empty(B, H, self.capacity, D)
            self.values[layer] = value.new_empty(B, H, self.capacity, D)
        kb, vb = self.keys[layer], self.values[layer]
        kb[..., L : L + q, :] = key
        vb[..., L : L + q, :] = value
        self.lengths[layer] = L + keep
        return kb[..., : L + q, :], vb[..., : L + q, :]

    def select(self, rows: torch.Tensor) -> None:
        """Keep only batch rows ``rows`` (LongTensor[B'])."""
        for d in (self.keys, self.values):
            for k in d:
                d[k] = d[k][rows]

    def expand(self, n: int) -> None:
        """Repeat a batch-1 cache to ``n`` rows (views without a capacity; copies with one, which later
        forwards write into). Raises ValueError if the batch is not 1."""
        for d in (self.keys, self.values):
            for k in d:
                if d[k].shape[0] != 1:
                    raise ValueError(f"expand: cache batch is {d[k].shape[0]}, must be 1")
                d[k] = d[k].expand(n, -1, -1, -1)
                if self.capacity is not None:
                    d[k] = d[k].contiguous()


def _block_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: SDPA with the explicit block mask and an optional KVCache.

    query ``[B, H, q, D]``, key/value ``[B, Hkv, q, D]``, attention_mask BoolTensor ``[1|B, 1, q, kv]``
    (True = attend). Returns ``([B, q, H, D], None)``.
    """
    if attention_mask is None or attention_mask.dtype != torch.bool:
        raise ValueError(
            "dice_block attention needs an explicit boolean block mask: call dice_ray.policy.model.forward_hidden"
        )
    cache: KVCache | None = kwargs.get("block_kv")
    if cache is not None:
        key, value = cache.update(module.layer_idx, key, value)
    if attention_mask.shape[-1] != key.shape[-2] or attention_mask.shape[-2] != query.shape[-2]:
        raise ValueError(
            f"attention_mask {tuple(attention_mask.shape)} does not match query length {query.shape[-2]} "
            f"and key length {key.shape[-2]} (cache {len(cache) if cache is not None else 0})"
        )
    rep = query.shape[1] // key.shape[1]
    gqa = {}
    if rep > 1 and query.device.type == "cpu":
        gqa["enable_gqa"] = True  # CPU: no copy; CUDA's fused kernels want equal heads when a mask is given
    elif rep > 1:
        key = key.repeat_interleave(rep, dim=1)
        value = value.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout if module.training else 0.0, scale=scaling,
        **gqa,
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_IMPL, _block_attention)


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
    model = Qwen3ForCausalLM(hf)
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
    attention); the bidirectional families pass a full (padding-only) mask.

    Args:
        input_ids: LongTensor[B, q].
        position_ids: LongTensor[q] or [B, q] (RoPE positions; the noisy copy repeats the clean ones).
        mask: BoolTensor[q, kv] or [B, q, kv], ``kv = len(cache) + q`` (see :func:`block_mask`).
        cache: a :class:`KVCache` holding keys/values of earlier tokens, or None.
        keep: what the cache stores of this pass (see :class:`KVCache`); ignored without a cache.

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

