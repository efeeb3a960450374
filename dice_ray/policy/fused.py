"""Fused Triton kernels for the learner's model: Liger-Kernel's SwiGLU MLP and RoPE (``cluster.fused_kernels``).

Liger-Kernel (Hsu et al. 2024, "Liger Kernel: Efficient Triton Kernels for LLM Training", arXiv 2410.10989,
``linkedin/Liger-Kernel``, the ``gpu`` extra: ``pip install 'dice-ray[gpu]'``) replaces elementwise chains of a
Llama-style decoder layer (SiLU * up, rotary embedding) with one Triton kernel each, forward and backward.
RMSNorm is not taken from Liger: every policy model already runs torch's own fused ``rms_norm``
(:class:`dice_ray.policy.model.RMSNorm`), three times faster than Liger's on an H200 and with a sixth of its
host time a call.

What :func:`apply_fused_kernels` changes, for the three families of :mod:`dice_ray.policy.families`
(``model.config.model_type`` qwen3 = SDAR / TraDo / DICE, llama = LLaDA, qwen2 = Dream):

* every ``<Family>MLP`` is replaced by a ``LigerSwiGLUMLP`` holding the same ``gate_proj`` / ``up_proj`` /
  ``down_proj`` Linear modules (``down(silu(gate(x)) * up(x))`` in one kernel);
* the module-global ``apply_rotary_pos_emb`` of the model's transformers module (``modeling_qwen3`` etc.,
  which ``<Family>Attention.forward`` calls) becomes a wrapper that runs ``liger_rotary_pos_emb`` on CUDA
  tensors and the original function on others. This one is process-wide: other models of the family in the
  same process (a KL reference copy, a sampler) use Liger's RoPE on CUDA too, with the same numerics.

Parameter names, the state dict and checkpoints are unchanged; cross-entropy is NOT patched (the policy applies
``lm_head`` itself: :func:`dice_ray.policy.model.token_logits`). Outputs and gradients equal the unpatched model's
within bf16 rounding (``tests/test_fused_kernels.py``), so rollout workers, which sample with the unpatched model
in other processes, and the learner see the same policy up to that rounding.
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch

from dice_ray.policy.model import replace_modules

KINDS: tuple[str, ...] = ("auto", "none", "liger")
_INSTALL = "pip install -e '.[gpu]' in a dice-ray checkout (pip install 'dice-ray[gpu]' from a package index)"
# model_type -> (transformers module, MLP class name)
_LIGER_FAMILIES: dict[str, tuple[str, str]] = {
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3MLP"),
    "llama": ("transformers.models.llama.modeling_llama", "LlamaMLP"),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2MLP"),
}


def apply_fused_kernels(model: torch.nn.Module, kind: str) -> list[str]:
    """Swap the fused kernels of ``kind`` into ``model`` in place (see the module docstring); returns what was patched.

    Call it once the model is on its device and before an optimizer / DeepSpeed engine is built around it (the
    parameters stay the same objects, so calling it later is harmless too, but a KL reference copied earlier stays
    unfused).

    Args:
        model: a transformers ``Qwen3ForCausalLM`` / ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` (unwrapped).
        kind: ``"none"`` nothing; ``"liger"`` Liger's SwiGLU and RoPE (needs CUDA and the ``gpu`` extra);
            ``"auto"`` ``"liger"`` when the model is on CUDA, Liger imports and supports the model type, else nothing.

    Returns:
        the names of what was patched, ``["swiglu", "rope"]`` for Liger (``["rope"]`` for a non-SiLU MLP), ``[]``
        for nothing.

    Raises:
        ValueError: (naming ``cluster.fused_kernels``) ``kind`` is not one of :data:`KINDS`; ``"liger"`` but
            Liger-Kernel (or Triton) does not import, the model's ``config.model_type`` has no Liger patch here, or
            the model is not on a CUDA device (Triton kernels are CUDA-only).
    """
    if kind not in KINDS:
        raise ValueError(f"cluster.fused_kernels={kind!r}: must be one of {KINDS}")
    if kind == "none":
        return []
    blocker = liger_blocker(model)
    if blocker is not None:
        if kind == "auto":
            return []
        raise ValueError(f"cluster.fused_kernels='liger': {blocker} (set fused_kernels to 'auto' or 'none')")
    return _patch_liger(model, _model_type(model), _import_liger())


def liger_blocker(model: torch.nn.Module) -> str | None:
    """Why Liger's kernels cannot be swapped into ``model`` now, in words, or None when they can.

    Checked in this order: the model is on a CUDA device (Triton kernels are CUDA-only); its
    ``config.model_type`` has a patch here; Liger-Kernel (and Triton under it) imports. The learner prints it
    when ``auto`` leaves the kernels off on a GPU.
    """
    device = _device_type(model)
    if device != "cuda":
        return f"the model is on {device}, and Liger's Triton kernels run on CUDA only"
    model_type = _model_type(model)
    if model_type not in _LIGER_FAMILIES:
        return f"no Liger patch for model_type {model_type!r}; supported: {sorted(_LIGER_FAMILIES)}"
    try:
        _import_liger()
    except ImportError as e:
        return f"Liger-Kernel does not import ({e}); install it with {_INSTALL}"
    return None


def _device_type(model: torch.nn.Module) -> str:
    """The device type of the model's first parameter (``"cpu"`` for a model without parameters)."""
    p = next(model.parameters(), None)
    return p.device.type if p is not None else "cpu"


def _model_type(model: torch.nn.Module) -> str:
    """``model.config.model_type`` in lower case (``"none"`` for a model without one)."""
    return str(getattr(getattr(model, "config", None), "model_type", None)).lower()


def _import_liger():
    """``liger_kernel.transformers`` (raises ImportError when it, or Triton under it, is missing)."""
    return importlib.import_module("liger_kernel.transformers")


def _patch_liger(model: torch.nn.Module, model_type: str, liger) -> list[str]:
    """Replace the MLP modules of ``model`` by Liger's and the family's RoPE function (see the module doc)."""
    module_name, mlp_name = _LIGER_FAMILIES[model_type]
    modeling = importlib.import_module(module_name)
    mlp_cls = getattr(modeling, mlp_name)
    if getattr(model.config, "hidden_act", "silu") in ("silu", "swish"):  # Liger's SwiGLU is SiLU only
        replace_modules(model, mlp_cls, lambda mlp: _liger_mlp(mlp, liger.LigerSwiGLUMLP))
    patched = ["swiglu"] if any(isinstance(m, liger.LigerSwiGLUMLP) for m in model.modules()) else []  # also on a second call
    rope = modeling.apply_rotary_pos_emb
    if getattr(rope, "_dice_unfused", None) is None:
        modeling.apply_rotary_pos_emb = _cuda_rope(rope, liger.liger_rotary_pos_emb)
    patched.append("rope")
    return patched


def _liger_mlp(mlp: torch.nn.Module, cls: type) -> torch.nn.Module:
    """A Liger SwiGLU MLP around ``mlp``'s own ``gate_proj`` / ``up_proj`` / ``down_proj`` Linear modules."""
    with torch.device("meta"):
        new = cls(mlp.config)  # config.intermediate_size; the Linear modules are replaced next
    new.gate_proj, new.up_proj, new.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
    new.train(mlp.training)
    return new


def _cuda_rope(original: Callable, fused: Callable) -> Callable:
    """``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``: ``fused`` on CUDA tensors, ``original`` on others.

    q ``[B, H, L, D]``, k ``[B, Hkv, L, D]``, cos / sin ``[B|1, L, D]``. Liger's kernel writes into q and k.
    """

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if q.is_cuda:
            return fused(q, k, cos, sin, None, unsqueeze_dim)
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb._dice_unfused = original
    return apply_rotary_pos_emb
