"""The SFT optimiser's schedule and clipping: AdamW's lr with a linear warm-up and a cosine decay to ``min_lr_ratio``,
and gradient-norm clipping with DeepSpeed's arithmetic (so the plain torch path takes the very steps of a ZeRO-0
float32 engine)."""

from __future__ import annotations

import math

import torch

from dice_ray.config import SFTConfig


def lr_at(step: int, cfg: SFTConfig) -> float:
    """The lr of optimizer step ``step`` (0-based): linear warm-up, then cosine decay to ``min_lr_ratio``."""
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
    return cfg.learning_rate * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cos)


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """Scale gradients in place so that their joint L2 norm is at most ``max_norm``; returns the norm before.

    The arithmetic of DeepSpeed's fp32 ``deepspeed.runtime.utils.clip_grad_norm_`` (per-tensor norms,
    squared and summed, square root; coefficient ``min(1, max_norm / (norm + 1e-6))``), not
    ``torch.nn.utils.clip_grad_norm_``'s (same value up to rounding): the plain path then takes the very steps
    of ``dice-ray sft``'s ZeRO-0 float32 engine.

    Args:
        parameters: iterable of tensors; those with a ``.grad`` are clipped (any float dtype).
        max_norm: the cap (> 0).

    Returns:
        fp32 tensor [] or [1]: the joint norm before clipping (0 when no gradient).
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    total = torch.stack([g.detach().float().norm(2.0) for g in grads]).pow(2.0).sum().float().pow(0.5)
    coef = torch.min(torch.tensor([1.0]).to(total.device),
                     torch.tensor([float(max_norm)]).to(total.device) / (total + 1e-6))
    for g in grads:
        g.detach().mul_(coef)
    return total
