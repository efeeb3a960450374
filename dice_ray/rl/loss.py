"""The clipped policy-gradient loss of the GRPO family on diffusion-policy log-probs.

PPO's clipped ratio (Schulman et al. 2017) per token, GRPO's group advantages (Shao et al. 2024),
the k3 KL estimator against a frozen reference policy (Schulman 2020, "Approximating KL
divergence"), token log-probs from TraceRL's per-denoising-step reconstruction (Wang et al. 2025,
the estimator DICE trains with). DICE: epsilon 0.2, beta 0.01.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossStats:
    """Diagnostics of one loss evaluation (plain floats, for metrics)."""

    loss: float
    clip_fraction: float
    kl: float
    ratio_mean: float


def clipped_policy_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon: float = 0.2,
    beta: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """PPO-clip + optional k3 KL, averaged over each sequence's tokens, then over sequences (GRPO).

    Args:
        logprobs: float [B, R], log pi_theta of each response token (differentiable).
        behaviour_logprobs: float [B, R], log-probs under the policy that sampled the rollout.
        advantages: float [B], one advantage a sequence (broadcast over its tokens).
        mask: bool [B, R], True on response tokens that count (not padding).
        epsilon: clip range of the ratio pi_theta / pi_behaviour.
        beta: k3 KL coefficient; needs ``ref_logprobs`` when > 0.
        ref_logprobs: float [B, R], log-probs under the frozen reference policy.

    Returns:
        (scalar loss to minimise, :class:`LossStats`).

    Raises:
        ValueError: shapes disagree, or ``beta > 0`` without ``ref_logprobs``.
    """
    if logprobs.shape != behaviour_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, behaviour_logprobs {tuple(behaviour_logprobs.shape)} "
            f"and mask {tuple(mask.shape)} must have one shape [B, R]"
        )
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must be [B]={logprobs.shape[0]}, got {tuple(advantages.shape)}")
    if beta > 0 and ref_logprobs is None:
        raise ValueError("beta > 0 needs ref_logprobs")
    m = mask.float()
    adv = advantages.float().unsqueeze(1)
    ratio = torch.exp(logprobs - behaviour_logprobs.detach())
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - epsilon, 1.0 + epsilon) * adv
    per_token = -torch.minimum(unclipped, clipped)
    kl = torch.zeros_like(per_token)
    if beta > 0:
        log_r = ref_logprobs.detach() - logprobs
        kl = torch.exp(log_r) - log_r - 1.0
        per_token = per_token + beta * kl
    tokens = m.sum(dim=1).clamp_min(1.0)
    loss = ((per_token * m).sum(dim=1) / tokens).mean()
    with torch.no_grad():
        n = m.sum().clamp_min(1.0)
        clip_frac = (((ratio - 1.0).abs() > epsilon).float() * m).sum() / n
        stats = LossStats(
            loss=float(loss.detach()),
            clip_fraction=float(clip_frac),
            kl=float((kl * m).sum() / n),
            ratio_mean=float((ratio * m).sum() / n),
        )
    return loss, stats
