"""Rollout worker actors: sample groups of completions from the diffusion policy.

Each worker holds a copy of the policy, takes new weights from the learner after every step
(:meth:`RolloutWorker.set_weights`), and turns each prompt request into a group of ``G`` rollouts
with their decoding traces and behaviour log-probs, plus the candidate source files they make.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import ray
import torch

from dice_ray.cluster.scheduler import PromptRequest
from dice_ray.config import ModelConfig, SamplingConfig
from dice_ray.tasks.task import Task


@dataclass
class GroupRollout:
    """One prompt's group: ``G`` rollouts and the candidate solution each makes.

    Attributes:
        request: the scheduler's request (task, phase, seed).
        rollouts: ``G`` :class:`~dice_ray.policy.sampler.Rollout` (token ids, unmask steps,
            behaviour log-probs).
        candidates: ``G`` candidate source files, assembled from the prompt's scaffold.
        tokens: response tokens generated for the group.
        seconds: wall time of sampling the group.
        weights_version: the learner step whose weights sampled it.
    """

    request: PromptRequest
    rollouts: list
    candidates: list[str]
    tokens: int
    seconds: float
    weights_version: int


@ray.remote(num_cpus=0)
class RolloutWorker:
    """A Ray actor sampling groups with block-diffusion decoding (see :mod:`dice_ray.policy.sampler`).

    Args:
        model_cfg: builds the policy's architecture (weights come by :meth:`set_weights`).
        sampling_cfg: decoding knobs.
        tasks: the tasks it may be asked to prompt, by id.
        template: prompt template set (``TasksConfig.prompt_template``).
        num_threads: torch CPU threads (0: leave torch's default).
        granularity: where infill scaffolds are cut (``PhaseConfig.scaffold_granularity``).
    """

    def __init__(
        self, model_cfg: ModelConfig, sampling_cfg: SamplingConfig, tasks: dict[str, Task], template: str,
        num_threads: int = 0, granularity: str = "source",
    ):
        from dice_ray.policy.policy import DiffusionPolicy

        if num_threads:
            torch.set_num_threads(num_threads)
        self.device = "cuda" if torch.cuda.is_available() and ray.get_gpu_ids() else "cpu"
        self.policy = DiffusionPolicy.from_config(model_cfg)
        self.policy.model.to(self.device)
        self.sampling_cfg = sampling_cfg
        self.tasks = tasks
        self.template = template
        self.granularity = granularity
        self.version = -1

    def set_weights(self, weights, version: int) -> int:
        """Take the learner's weights for ``version``; returns the version held.

        Args:
            weights: a state dict of CPU tensors (object-store sync), or a
                :class:`~dice_ray.cluster.weight_sync.BroadcastSpec` naming this worker's rank in the
                weight-sync group: the worker joins the group on the first one (and on a new generation),
                then receives the buckets learner rank 0 broadcasts (:mod:`dice_ray.cluster.weight_sync`).
        """
        from dice_ray.cluster.weight_sync import BroadcastGroup, BroadcastSpec

        if isinstance(weights, BroadcastSpec):
            group = getattr(self, "weight_group", None)
            if group is None or not group.current(weights):
                self.weight_group = BroadcastGroup(weights, torch.device(self.device))
            self.weight_group.receive(self.policy.model)
        else:
            self.policy.model.load_state_dict(weights)
        self.version = version
        return version

    def generate(self, requests: list[PromptRequest], num_generations: int) -> list[GroupRollout]:
        """Sample ``num_generations`` completions for each request.

        Raises:
            KeyError: a request names a task this worker was not given.
        """
        from dice_ray.policy.sampler import sample_group
        from dice_ray.tasks.prompts import assemble_candidate, build_prompt

        out = []
        for req in requests:
            task = self.tasks[req.task_id]
            prompt = build_prompt(task, req.phase, self.template, self.granularity)
            t0 = time.perf_counter()
            rollouts = sample_group(self.policy, prompt, num_generations, self.sampling_cfg, seed=req.seed)
            seconds = time.perf_counter() - t0
            candidates = [assemble_candidate(task, req.phase, r.text, self.granularity) for r in rollouts]
            tokens = sum(len(r.response_ids) for r in rollouts)
            out.append(GroupRollout(req, rollouts, candidates, tokens, seconds, self.version))
        return out
