"""What the sampler returns (:mod:`dice_ray.policy.sampler`): a group's rollouts and the call's throughput.

Plain data, apart from the sampler: the trainer (the driver) receives groups from the rollout actors and
unpickles them, which imports this module, not the model stack (transformers: seconds of CPU a run).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Rollout:
    """One sample of a group.

    Attributes:
        prompt_ids: prompt token ids (length P).
        response_ids: response token ids, length a multiple of ``block_size`` (R).
        unmask_step: per response token, the denoising step (0-based, within its block) that unmasked it.
        behaviour_logprobs: per response token, log p(token) under the temperature-1 policy at that step.
        text: the response decoded up to (not including) the first ``<|eos|>``.
        finished: True when the response holds ``<|eos|>`` (False: cut at ``max_new_tokens``).
        suffix_ids: infilling only (:func:`infill_group`): the fixed tokens after the span ``response_ids``.
        tail_ids, tail_steps: LLaDA / Dream: the canvas positions after the response's first ``eos`` up to the
            last one the sampler decoded before it stopped (it decodes by confidence, so a position after the
            eventual ``eos`` may come first): the token and step there, ``<|mask|>`` and -1 where never
            decoded. Not part of the response (no reward, no loss), but part of the later denoising states:
            the TraceRL replay shows them (:func:`dice_ray.policy.logprobs.tracerl_logprobs`). Empty otherwise.
        span_lengths: LLaDA / Dream: for each denoising step of this sample (index = the step, as counted by
            ``unmask_step``; length = the steps it took, so every ``unmask_step`` is below it), the length in tokens
            of the span (canvas) that step's forward decoded, masked positions included: ``max_new_tokens`` at
            every step for whole-response decoding; for a grown infill span ``block_size`` at first, then a block
            more after each step that filled it without an ``eos``. The state at step ``s`` is the prompt, the first
            ``span_lengths[s]`` canvas positions (``response_ids ‖ tail_ids`` where ``unmask_step < s``, else
            ``<|mask|>``) and ``suffix_ids``. Empty for SDAR (fixed blocks).

    SDAR responses are a multiple of ``block_size`` long; LLaDA / Dream responses end at their first ``eos``.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    unmask_step: list[int]
    behaviour_logprobs: list[float]
    text: str
    finished: bool
    suffix_ids: list[int] = field(default_factory=list)
    tail_ids: list[int] = field(default_factory=list)
    tail_steps: list[int] = field(default_factory=list)
    span_lengths: list[int] = field(default_factory=list)


@dataclass
class SampleStats:
    """Throughput of one :func:`sample_group` call (or of a group's share of a batch of groups, ``sample_groups``;
    or of a whole batch, ``sample_ids_batch``: rows and prompts summed).

    Attributes:
        num_samples: G (a whole batch: its rows).
        prompt_tokens: P (a whole batch: the prompts' sum).
        new_tokens: sum of the G response lengths (tokens).
        forwards: model forward passes (prefill + denoising steps; a group of a batch: the batch's).
        seconds: wall time (s); a group of a batch: the batch's times the group's share of its rows.
        tokens_per_s: new_tokens / seconds.
    """

    num_samples: int
    prompt_tokens: int
    new_tokens: int
    forwards: int
    seconds: float
    tokens_per_s: float


class RolloutGroup(list):
    """``list[Rollout]`` with the call's :class:`SampleStats` as ``.stats``."""

    stats: SampleStats
