"""Sampling a group of rollouts for a task and phase, posed the way the policy's family decodes.

One entry point for the rollout workers (:meth:`dice_ray.cluster.rollout.RolloutWorker.generate`, through
:func:`sample_task_groups`, several groups a batch) and eval (:func:`dice_ray.eval.run.model_candidates`), so training
and evaluation pose a task alike:

* SDAR, every phase, and LLaDA / Dream end-to-end: the phase's prompt (:func:`~dice_ray.tasks.prompts.build_prompt`;
  an infill prompt shows the scaffold with the middle marked missing, as DICE's SDAR rollouts do), decoded by
  :func:`~dice_ray.policy.sampler.sample_group`;
* LLaDA / Dream infill: the middle decoded in place between the scaffold's two sides
  (:func:`~dice_ray.tasks.prompts.infill_context`, :func:`~dice_ray.policy.sampler.infill_group`), the span grown a
  block at a time up to ``sampling.max_new_tokens``; the rollouts carry the suffix and the span trace the learner's
  log-probs replay (:mod:`dice_ray.policy.logprobs`).

Each rollout's text becomes a candidate source file by :func:`~dice_ray.tasks.prompts.assemble_candidate`.
:func:`context_tokens` measures the fixed context a task and phase give the policy, so that a run can leave out the
prompts that, with ``sampling.max_new_tokens`` more, would not fit the model's positions.
"""

from __future__ import annotations

from dice_ray.config import SamplingConfig
from dice_ray.policy.policy import DiffusionPolicy
from dice_ray.policy.sampler import infill_group, sample_group, sample_groups
from dice_ray.policy.samples import RolloutGroup
from dice_ray.tasks.prompts import assemble_candidate, build_prompt, infill_context
from dice_ray.tasks.task import Task


def sample_task_group(
    policy: DiffusionPolicy,
    task: Task,
    phase: str,
    template: str,
    granularity: str,
    num_samples: int,
    sampling_cfg: SamplingConfig,
    seed: int,
) -> tuple[RolloutGroup, list[str]]:
    """Sample ``num_samples`` rollouts of ``task`` in ``phase`` and the candidate source each makes.

    Deterministic for a given policy, task, phase, template, granularity, config and seed (on one device).

    Args:
        policy: the diffusion policy (its family picks the layout, see the module doc).
        task: the task to pose.
        phase: ``"infill"`` or ``"e2e"``.
        template: prompt template set (``tasks.prompt_template``: ``"compact"`` or ``"dice"``).
        granularity: where infill scaffolds are cut (``phase.scaffold_granularity``: ``"source"`` or ``"body"``).
        num_samples: group size G.
        sampling_cfg: decoding knobs (``sampling``; ``max_new_tokens`` also caps a grown infill span).
        seed: seeds the group's draws.

    Returns:
        (the :class:`~dice_ray.policy.samples.RolloutGroup` of G rollouts, with ``.stats``; G candidate sources,
        ``assemble_candidate(task, phase, rollout.text, granularity)`` each).

    Raises:
        ValueError: an unknown ``phase`` or ``template``, ``num_samples < 1``, or a prompt too long for the model
            (see :func:`~dice_ray.policy.sampler.sample_group`, :func:`~dice_ray.policy.sampler.infill_group`).
        ScaffoldError: ``phase == "infill"`` and the task has no solution to cut at ``granularity`` (a ValueError).
    """
    if phase == "infill" and policy.family != "sdar":
        before, after = infill_context(task, template, granularity)
        group = infill_group(policy, before, after, num_samples, sampling_cfg, seed)
    else:
        prompt = build_prompt(task, phase, template, granularity)
        group = sample_group(policy, prompt, num_samples, sampling_cfg, seed)
    return group, [assemble_candidate(task, phase, r.text, granularity) for r in group]


def sample_task_groups(
    policy: DiffusionPolicy,
    items: list[tuple[Task, str, int]],
    template: str,
    granularity: str,
    num_samples: int,
    sampling_cfg: SamplingConfig,
) -> list[tuple[RolloutGroup, list[str]]]:
    """:func:`sample_task_group` of each ``(task, phase, seed)`` of ``items``, SDAR groups decoded several a batch.

    SDAR (every phase: the scaffold is in the prompt): the prompts, longest first (similar lengths share a batch, so
    little padding), go in batches of ``max(1, sampling.max_batch_rows // num_samples)`` groups
    (:func:`~dice_ray.policy.sampler.sample_groups`); each group keeps its own seed, so its rollouts are those
    :func:`sample_task_group` gives it alone, up to floating-point rounding. LLaDA / Dream: one group after another
    (:func:`sample_task_group`). Each group's ``.stats.seconds`` is its share of its batch's wall time.

    Returns:
        per item, in order, what :func:`sample_task_group` returns.

    Raises:
        ValueError / ScaffoldError: as :func:`sample_task_group`, for any item (before anything is sampled for SDAR).
    """
    if policy.family != "sdar":
        return [sample_task_group(policy, task, phase, template, granularity, num_samples, sampling_cfg, seed)
                for task, phase, seed in items]
    prompts = [build_prompt(task, phase, template, granularity) for task, phase, _ in items]
    lengths = [len(policy.encode(p)) for p in prompts]
    order = sorted(range(len(items)), key=lambda i: -lengths[i])  # stable: equal lengths keep their order
    per_batch = max(1, sampling_cfg.max_batch_rows // num_samples)
    groups: dict[int, RolloutGroup] = {}
    for k in range(0, len(order), per_batch):
        part = order[k:k + per_batch]
        batch = sample_groups(policy, [prompts[i] for i in part], num_samples, sampling_cfg, [items[i][2] for i in part])
        groups.update(zip(part, batch))
    return [(groups[i], [assemble_candidate(task, phase, r.text, granularity) for r in groups[i]])
            for i, (task, phase, _) in enumerate(items)]


def context_tokens(policy: DiffusionPolicy, task: Task, phase: str, template: str, granularity: str) -> int:
    """Tokens of the fixed context :func:`sample_task_group` gives the policy for ``task`` in ``phase``: the prompt
    (SDAR, and LLaDA / Dream end-to-end), or the scaffold's two sides around the span (LLaDA / Dream infill).
    With ``sampling.max_new_tokens`` more it must fit ``model.max_position_embeddings``.

    Raises:
        ValueError / ScaffoldError: as :func:`sample_task_group` (unknown phase or template; nothing to cut).
    """
    if phase == "infill" and policy.family != "sdar":
        before, after = infill_context(task, template, granularity)
        return len(policy.encode(before)) + len(policy.encode(after))
    return len(policy.encode(build_prompt(task, phase, template, granularity)))
