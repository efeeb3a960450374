"""The learner's decoder layers and log-prob head through ``torch.compile``: fewer, fused kernel launches an update.

An eager decoder layer of the policy is ~30 kernel launches forward and more backward, each a Python call with
autograd bookkeeping; at the SDAR-1.7B shape (28 layers, an update of two groups of 16 responses scored in 6
passes) that is tens of thousands of launches an update, and the GPU waits on the host (issue 42: ~0.74 s of a
2.8 s update on an H200). :func:`compile_layers` replaces each decoder layer's ``forward`` by two compiled
regions around the one part that cannot be traced cheaply, the :class:`~dice_ray.policy.model.KVCache` update
(Python bookkeeping of a per-layer dict):

* ``pre``: input RMSNorm, q / k / v projections, Qwen3's q / k RMSNorm, RoPE -> q, k, v;
* the cache update (eager: the training cache concatenates committed ‖ new keys);
* ``post``: attention over the block mask (FlexAttention over the pass's ``BlockMask`` when the model's attention
  is ``flex``, :func:`dice_ray.policy.model.set_attention`, else SDPA over the dense mask), ``o_proj``, residual,
  post-attention RMSNorm, SwiGLU MLP, residual.

Inductor fuses the elementwise chains (RoPE, SiLU * up, residual adds, norms) and each region is one autograd node,
so its backward is one compiled graph too. The layer's math is transformers' own Qwen3 / Llama / Qwen2 decoder layer
(same modules, same parameters, same state dict); Liger's SwiGLU modules (``cluster.fused_kernels``) are called
through their ``gate_proj`` / ``up_proj`` / ``down_proj`` and Liger's RoPE is replaced by the unfused function
inside the compiled regions (Inductor fuses both itself). Outputs and gradients equal the eager model's within
float rounding (``tests/test_policy_flex.py``).

:func:`token_logprobs` is the policy's log-prob head (``lm_head``, fp32, ``<|mask|>`` excluded, log-softmax,
gather) as one compiled region: the fp32 ``[n, V]`` logits and their log-softmax are not written out as separate
tensors, forward or backward.

Compilation settings: default mode (no CUDA graphs: shapes change every group, and DeepSpeed's gradient hooks run
between the regions), ``dynamic=None`` (the first shape compiles static; a second one recompiles with symbolic
lengths and batch, then no more recompiles however prompt and response lengths vary). All layers share the two
compiled functions (the layer is an argument; parameters are graph inputs), so a 28-layer model compiles each
region once, not once a layer. If compiling fails (no C compiler, an unsupported op, a Dynamo error), one line on
stderr says so and every later call runs the same functions eagerly (:func:`compile_fallback_reason`).
"""

from __future__ import annotations

import sys
import types
from typing import Callable

import torch
import torch.nn.functional as F

from dice_ray.policy.model import attend, check_attention_shapes

__all__ = ["compile_layers", "compile_blocker", "compile_fallback_reason", "is_compiled", "token_logprobs"]

_state: dict = {"pre": None, "post": None, "head": None, "broken": None, "backend": "inductor"}
_REQUIRED = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")


def compile_blocker(model: torch.nn.Module) -> str | None:
    """Why :func:`compile_layers` cannot serve ``model``, in words, or None when it can.

    Checked: Dynamo supports this Python; the model has ``model.model.layers`` of Llama-style decoder layers
    (``self_attn`` with ``q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj``, an ``mlp`` with ``gate_proj`` / ``up_proj`` /
    ``down_proj``, two RMSNorms); no attention dropout; no earlier compile failure in this process.
    """
    if not torch._dynamo.is_dynamo_supported():
        return f"torch.compile does not support Python {sys.version.split()[0]} here"
    if _state["broken"]:
        return f"torch.compile failed earlier in this process: {_state['broken']}"
    model = getattr(model, "module", model)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        return f"{type(model).__name__} has no model.layers of decoder layers"
    for layer in layers:
        missing = [n for n in _REQUIRED if not hasattr(layer, n)]
        missing += [f"self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj")
                    if not hasattr(getattr(layer, "self_attn", None), n)]
        missing += [f"mlp.{n}" for n in ("gate_proj", "up_proj", "down_proj") if not hasattr(getattr(layer, "mlp", None), n)]
        if missing:
            return f"{type(layer).__name__} lacks {', '.join(missing)}"
    if getattr(model.config, "attention_dropout", 0.0):
        return f"attention_dropout {model.config.attention_dropout} (the compiled layer has none)"
    return None


def compile_layers(model: torch.nn.Module) -> int:
    """Give every decoder layer of ``model`` the compiled forward of the module docstring, in place; returns how many.

    Call it on the module (a DeepSpeed engine's ``.module`` is unwrapped), after :func:`dice_ray.policy.fused.
    apply_fused_kernels` and before ``deepspeed.initialize`` and any checkpointing wrapper of ``layer.forward``.
    The new forward is a method bound to its layer, so ``copy.deepcopy(model)`` (a KL reference) copies it bound to
    the copy. Compilation itself happens at the first forward. A second call changes nothing.

    Raises:
        ValueError: :func:`compile_blocker` names something in the way.
    """
    blocker = compile_blocker(model)
    if blocker is not None:
        raise ValueError(f"compile_layers: {blocker}")
    model = getattr(model, "module", model)
    for layer in model.model.layers:
        layer.forward = types.MethodType(_layer_forward, layer)
    model.dice_compiled = True
    return len(model.model.layers)


def is_compiled(model: torch.nn.Module) -> bool:
    """True when :func:`compile_layers` was applied to ``model`` (its log-probs then use :func:`token_logprobs`)."""
    return bool(getattr(getattr(model, "module", model), "dice_compiled", False))


def compile_fallback_reason() -> str | None:
    """Why compiling was given up in this process (the compiled functions run eagerly since), or None."""
    return _state["broken"]


def token_logprobs(model: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, mask_id: int) -> torch.Tensor:
    """FloatTensor[n] ``log p(targets)`` from hidden states ``[n, hidden]`` under the policy's distribution
    (:func:`dice_ray.policy.model.token_logits`: fp32 logits, ``<|mask|>`` excluded), as one compiled region."""
    model = getattr(model, "module", model)
    return _call("head", _head, model.lm_head, hidden, targets, mask_id)


# ---- the compiled functions ----------------------------------------------------------------------------------


def _head(lm_head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, mask_id: int) -> torch.Tensor:
    logits = lm_head(hidden).float()
    logits[..., mask_id] = float("-inf")
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _rope_of(attn: torch.nn.Module) -> Callable:
    """The family's ``apply_rotary_pos_emb`` as transformers wrote it (Liger's wrapper unwrapped)."""
    fn = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    return getattr(fn, "_dice_unfused", None) or fn


def _pre(layer: torch.nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: Callable):
    """Input norm, q / k / v ``[B, heads, q, head_dim]`` with Qwen3's q / k norms and RoPE (transformers' order)."""
    attn = layer.self_attn
    x = layer.input_layernorm(hidden)
    shape = (*x.shape[:-1], -1, attn.head_dim)
    q, k = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape)
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    v = attn.v_proj(x).view(shape).transpose(1, 2)
    q, k = rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return q, k, v


def _post(layer: torch.nn.Module, hidden: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          mask: torch.Tensor, flex_mask) -> torch.Tensor:
    """Attention, ``o_proj``, residual, post-attention norm, SwiGLU MLP, residual -> the layer's output."""
    attn = layer.self_attn
    if flex_mask is not None and torch.compiler.is_compiling():  # traced into this region's graph
        from torch.nn.attention.flex_attention import flex_attention

        o = flex_attention(q, k, v, block_mask=flex_mask, scale=attn.scaling,
                           enable_gqa=q.shape[1] != k.shape[1]).transpose(1, 2)
    else:  # eager (a compile failure, or CPU training): the model's own attention, compiled FlexAttention on CUDA
        o = attend(q, k, v, mask, flex_mask, attn.scaling)
    h = hidden + attn.o_proj(o.reshape(*o.shape[:2], -1))
    mlp = layer.mlp
    y = layer.post_attention_layernorm(h)
    act = getattr(mlp, "act_fn", F.silu)  # Liger's SwiGLU module is SiLU only and has no act_fn
    return h + mlp.down_proj(act(mlp.gate_proj(y)) * mlp.up_proj(y))


def _layer_forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs) -> torch.Tensor:
    """A decoder layer's forward (bound to the layer by :func:`compile_layers`): compiled ``pre``, the KV-cache
    update (eager), compiled ``post``. Takes what transformers' model loop passes (``block_kv`` / ``block_flex``
    from :func:`dice_ray.policy.model.forward_hidden`; ``position_ids``, ``cache``, ``use_cache`` ignored)."""
    if attention_mask is None or attention_mask.dtype != torch.bool:
        raise ValueError(
            "dice_block attention needs an explicit boolean block mask: call dice_ray.policy.model.forward_hidden"
        )
    cos, sin = position_embeddings
    q, k, v = _call("pre", _pre, self, hidden_states, cos, sin, _rope_of(self.self_attn))
    cache = kwargs.get("block_kv")
    if cache is not None:
        k, v = cache.update(self.self_attn.layer_idx, k, v)
    check_attention_shapes(q, k, attention_mask, cache)
    flex_mask = kwargs.get("block_flex")
    if flex_mask is not None and not q.is_cuda and torch.is_grad_enabled():
        # PyTorch has no FlexAttention backward on CPU: run this part eagerly, so its own error says so (and a
        # compile failure is not recorded for what is not one)
        return _post(self, hidden_states, q, k, v, attention_mask, flex_mask)
    return _call("post", _post, self, hidden_states, q, k, v, attention_mask, flex_mask)


def _call(name: str, eager: Callable, *args):
    """``torch.compile(eager)(*args)`` (compiled once a process), or ``eager(*args)`` once compiling has failed.

    Only a compile failure (Dynamo's ``TorchDynamoException``: an unsupported construct, a backend or Inductor
    error, which Dynamo wraps in ``BackendCompilerFailed``) falls back. Every other exception passes through
    unchanged: an out-of-memory error, an error of the layer's own math, and the exception with which
    ``torch.utils.checkpoint`` ends a recomputation early from inside a region (caught here, it re-ran the layer
    eagerly mid-recomputation and failed with "target_frame.early_stop is set": the H100 run of
    ``benchmarks/learner_throughput.py --variants flex+compile`` with ``--grad-ckpt layers``)."""
    if _state["broken"]:
        return eager(*args)
    fn = _state[name]
    if fn is None:
        fn = _state[name] = torch.compile(eager, dynamic=None, backend=_state["backend"])
    try:
        return fn(*args)
    except torch._dynamo.exc.TorchDynamoException as e:  # a compile failure: eager from now on, said once
        text = str(e).strip()
        _state["broken"] = f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:300]
        print(f"dice-ray: torch.compile of the learner's layers failed ({_state['broken']}); they run eagerly for "
              f"the rest of this process", file=sys.stderr, flush=True)
        return eager(*args)
