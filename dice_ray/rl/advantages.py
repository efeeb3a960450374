"""Group-relative advantages (GRPO, Shao et al. 2024 "DeepSeekMath"; as used by DICE / TraceRL)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GroupAdvantages:
    """Advantages of a batch of groups.

    Attributes:
        advantages: float32 [num_groups, G]; zero for dropped groups.
        keep: bool [num_groups]; False where every reward in the group is equal (no signal).
    """

    advantages: torch.Tensor
    keep: torch.Tensor

    @property
    def num_dropped(self) -> int:
        """Groups dropped because all their rewards were equal."""
        return int((~self.keep).sum())


def group_advantages(rewards: torch.Tensor, scale_rewards: bool = True, eps: float = 1e-6) -> GroupAdvantages:
    """Centre each group's rewards on its mean and, with ``scale_rewards``, divide by its std.

    Args:
        rewards: float [num_groups, G], one row a prompt, one column a sample (a rollout).
        scale_rewards: divide by the group's standard deviation (GRPO's z-score; TRL's
            ``scale_rewards``). Dr. GRPO (Liu et al. 2025) argues for False.
        eps: a group whose reward std is below ``eps`` is dropped (DICE drops such groups).

    Returns:
        :class:`GroupAdvantages`.

    Raises:
        ValueError: ``rewards`` is not 2-D with at least 2 samples a group, or holds NaN/inf.
    """
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [num_groups, G>=2], got shape {tuple(rewards.shape)}")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards hold NaN or inf")
    rewards = rewards.float()
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, unbiased=False, keepdim=True)
    keep = std.squeeze(1) > eps
    adv = rewards - mean
    if scale_rewards:
        adv = adv / std.clamp_min(eps)
    adv = torch.where(keep.unsqueeze(1), adv, torch.zeros_like(adv))
    return GroupAdvantages(advantages=adv, keep=keep)
