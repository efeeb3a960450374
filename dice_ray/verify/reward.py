"""Reward of one verdict: correctness gate plus a clipped log-speedup bonus.

DICE (arXiv 2602.11715) rewards 1 for compiled-and-correct (one trial, allclose 1e-2) and has no
speed term and no anti-cheat rule; dice-ray zeroes any rule break and adds a bounded speed term so
that faster correct kernels win inside a group (GRPO advantages are group z-scores).
"""

from __future__ import annotations

import math

from dice_ray.config import RewardConfig


def compute_reward(
    compiled: bool, correct: bool | None, cheat: bool, speedup: float | None, cfg: RewardConfig
) -> float:
    """Reward of one candidate.

    ``0`` unless compiled, not a cheat and correct; compile-only (``correct is None``):
    ``cfg.compile_only_reward``; correct: ``cfg.correct_reward + cfg.speedup_weight *
    clip(log2(speedup), -cfg.speedup_clip_low, cfg.speedup_clip_high)`` (no speed term when
    ``speedup`` is None, i.e. not timed).  With the defaults: 1.0 at parity, 1.5 at 2x, 2.5 at
    >= 8x, 0.5 at <= 0.5x.

    Args:
        compiled: the candidate compiled and loaded.
        correct: matched the reference on every trial; None when not measured.
        cheat: an anti-cheat rule was broken.
        speedup: ``ref_ms / candidate_ms`` (dimensionless), or None.
    Raises:
        ValueError: ``speedup`` is not a positive finite number (``inf`` is clipped, not refused).
    """
    if speedup is not None and (math.isnan(speedup) or speedup <= 0):
        raise ValueError(f"speedup must be > 0, got {speedup!r}")
    if not compiled or cheat or correct is False:
        return 0.0
    if correct is None:
        return float(cfg.compile_only_reward)
    reward = float(cfg.correct_reward)
    if speedup is not None:
        bonus = max(-cfg.speedup_clip_low, min(cfg.speedup_clip_high, math.log2(speedup)))
        reward += cfg.speedup_weight * bonus
    return reward
