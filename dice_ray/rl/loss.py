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
    """Diagnostics of one loss evaluation (plain floats, for metrics).

    ``clip_fraction``, ``kl`` and ``ratio_mean`` are means over the ``tokens`` counted (the mask's True entries).
    """

    loss: float
    clip_fraction: float
    kl: float
    ratio_mean: float
    tokens: int = 0


def clipped_policy_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon: float = 0.2,
    beta: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    num_sequences: int | None = None,
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
        num_sequences: the sequences the mean over sequences divides by: None (default) the B given; a group's
            size G when these B rows are one chunk of it (a row chunk of the learner): the loss is then the
            chunk's part of the group's loss, ``sum over its rows of the per-token mean / G``, and the losses
            of a group's chunks sum to the loss of the whole group.

    Returns:
        (scalar loss to minimise, :class:`LossStats`).

    Raises:
        ValueError: shapes disagree, ``beta > 0`` without ``ref_logprobs``, or ``num_sequences < B``.
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
    if num_sequences is not None and num_sequences < logprobs.shape[0]:
        raise ValueError(f"num_sequences={num_sequences}: must be >= the {logprobs.shape[0]} rows given (a chunk's "
                         "group holds at least its rows)")
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
    per_sequence = (per_token * m).sum(dim=1) / tokens
    loss = per_sequence.mean() if num_sequences is None else per_sequence.sum() / num_sequences
    with torch.no_grad():
        n = m.sum().clamp_min(1.0)
        clip_frac = (((ratio - 1.0).abs() > epsilon).float() * m).sum() / n
        stats = LossStats(
            loss=float(loss.detach()),
            clip_fraction=float(clip_frac),
            kl=float((kl * m).sum() / n),
            ratio_mean=float((ratio * m).sum() / n),
            tokens=int(m.sum()),
        )
    return loss, stats


def merge_chunk_stats(parts: list[LossStats]) -> LossStats:
    """The diagnostics of a whole group from those of its row chunks (each evaluated with ``num_sequences`` = the
    group's size): the losses summed (each is its chunk's share of the group's), the token means weighted by
    each chunk's tokens, as one evaluation over the whole group gives them.

    Raises:
        ValueError: no parts.
    """
    if not parts:
        raise ValueError("merge_chunk_stats: no chunk stats")
    n = sum(p.tokens for p in parts)

    def mean(key: str) -> float:
        return sum(getattr(p, key) * p.tokens for p in parts) / n if n else 0.0

    return LossStats(loss=sum(p.loss for p in parts), clip_fraction=mean("clip_fraction"), kl=mean("kl"),
                     ratio_mean=mean("ratio_mean"), tokens=n)
