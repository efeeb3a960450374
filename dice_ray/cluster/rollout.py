"""Rollout worker actors: sample groups of completions from the diffusion policy.

Each worker holds a copy of the policy, takes new weights from the learner after every step
(:meth:`RolloutWorker.set_weights`), and turns each prompt request into a group of ``G`` rollouts
with their decoding traces and behaviour log-probs, plus the candidate source files they make.

Workers are restartable (issue 6: "a rollout worker killed: restarted, weights re-synced, its prompts
re-sampled"): the trainer creates them with ``max_restarts=ROLLOUT_MAX_RESTARTS`` and no task retries.
A restarted worker is a fresh process with random weights, so it refuses to sample
(:class:`WeightsMissing`) until it is given weights; :class:`~dice_ray.cluster.pipeline.StepPipeline`
waits for it (:func:`wait_until_alive`), re-syncs it and re-sends its prompts.
"""

from __future__ import annotations

import os
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
        rollouts: ``G`` :class:`~dice_ray.policy.samples.Rollout` (token ids, unmask steps,
            behaviour log-probs).
        candidates: ``G`` candidate source files, assembled from the prompt's scaffold.
        tokens: response tokens generated for the group.
        seconds: wall time of sampling the group: its share of the batch it was decoded in (the batch's time
            times the group's share of its rows, ``sampling.max_batch_rows``), so a call's groups add up to its
            sampling time and ``tokens / seconds`` is the batch's rate.
        weights_version: the learner step whose weights sampled it.
    """

    request: PromptRequest
    rollouts: list
    candidates: list[str]
    tokens: int
    seconds: float
    weights_version: int


ROLLOUT_MAX_RESTARTS = -1
"""Ray ``max_restarts`` of a rollout worker (-1: always restart; a shard that keeps failing is bounded by
:data:`~dice_ray.cluster.pipeline.MAX_SHARD_FAILURES` instead)."""
RESTART_TIMEOUT_S = 300.0
"""How long :func:`wait_until_alive` waits for a restarted worker (model build included)."""
FAULT_ENV = "DICE_RAY_FAULT_ROLLOUT_EXIT"
"""Test hook: ``"<k>:<marker path>"`` makes the first worker to reach its ``k``-th ``generate`` call
(1-based) while ``marker path`` does not exist create it and ``os._exit(1)`` (a crash, once a run)."""


def tasks_of(requests: list[PromptRequest], tasks: dict[str, Task]) -> dict[str, Task]:
    """The tasks ``requests`` name, by id: what one :meth:`RolloutWorker.generate` call needs.

    Raises:
        KeyError: a request names a task not in ``tasks``.
    """
    return {r.task_id: tasks[r.task_id] for r in requests}


class WeightsMissing(RuntimeError):
    """A worker was asked to sample before it held any weights (a restarted worker not re-synced yet)."""


def wait_until_alive(worker, timeout_s: float = RESTART_TIMEOUT_S) -> int:
    """Block until ``worker`` answers :meth:`RolloutWorker.ping` (after a restart); the version it holds.

    Args:
        worker: a :class:`RolloutWorker` handle.
        timeout_s: how long to wait (s).

    Returns:
        the weights version the worker holds (-1: none, a fresh process).

    Raises:
        RuntimeError: no answer within ``timeout_s`` (restarts exhausted, or the worker cannot start).
    """
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            return ray.get(worker.ping.remote(), timeout=max(0.1, deadline - time.monotonic()))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            last = e
            time.sleep(0.2)
    raise RuntimeError(f"rollout worker {worker} did not come back within {timeout_s:.0f} s of a failure: {last}")


def _fault_hook(calls: int) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    k, _, marker = spec.partition(":")
    if calls != int(k) or not marker:
        return
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    os._exit(1)


@ray.remote(num_cpus=0)
class RolloutWorker:
    """A Ray actor sampling groups with block-diffusion decoding (see :mod:`dice_ray.policy.sampler`).

    Args:
        model_cfg: builds the policy's architecture (weights come by :meth:`set_weights`).
        sampling_cfg: decoding knobs.
        template: prompt template set (``TasksConfig.prompt_template``).
        num_threads: torch CPU threads (0: leave torch's default).
        granularity: where infill scaffolds are cut (``PhaseConfig.scaffold_granularity``).
        free_cache: on a GPU, hand the CUDA cache back after every :meth:`generate` (the KV cache and the sampling
            working set; the weights stay): set when the worker shares the learner's GPU
            (``cluster.colocate_rollout``), so the learner's states fit again when they come back for its step.
    """

    def __init__(
        self, model_cfg: ModelConfig, sampling_cfg: SamplingConfig, template: str, num_threads: int = 0,
        granularity: str = "source", free_cache: bool = False,
    ):
        from dice_ray.policy.policy import DiffusionPolicy

        if num_threads:
            torch.set_num_threads(num_threads)
        self.device = "cuda" if torch.cuda.is_available() and ray.get_gpu_ids() else "cpu"
        self.policy = DiffusionPolicy.from_config(model_cfg)
        self.policy.model.to(self.device)
        self.sampling_cfg = sampling_cfg
        self.template = template
        self.granularity = granularity
        self.free_cache = free_cache
        self.version = -1
        self.calls = 0

    def ping(self) -> int:
        """The weights version held (-1: none yet); answering at all means the actor is up."""
        return self.version

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

    def set_version(self, version: int) -> int:
        """Call the weights held ``version`` (a learner step that changed no weight: nothing to load); returns the
        version held now, ``-1`` when this process holds none (restarted since the last push: it needs
        :meth:`set_weights`)."""
        if self.version >= 0:
            self.version = version
        return self.version

    def context_tokens(self, items: list[tuple[Task, str]]) -> list[int]:
        """Tokens of the fixed context of each ``(task, phase)`` (:func:`~dice_ray.policy.task_sampling.context_tokens`):
        the trainer leaves out the prompts that would not fit the model with ``sampling.max_new_tokens`` more."""
        from dice_ray.policy.task_sampling import context_tokens

        return [context_tokens(self.policy, task, phase, self.template, self.granularity) for task, phase in items]

    def generate(self, requests: list[PromptRequest], num_generations: int, tasks: dict[str, Task]) -> list[GroupRollout]:
        """Sample ``num_generations`` completions for each request: SDAR decodes the requests' groups several a batch
        (up to ``sampling.max_batch_rows`` rows, :func:`~dice_ray.policy.task_sampling.sample_task_groups`), each
        group from its own seed (``PromptRequest.seed``).

        The tasks come with the call, not the constructor: constructor arguments that large sit in
        Ray's object store, which a restartable actor must not rely on (ray-project/ray#53727).

        Args:
            requests: the prompts to sample.
            num_generations: group size ``G``.
            tasks: at least the requests' tasks, by id (:func:`tasks_of`).

        Raises:
            KeyError: a request names a task missing from ``tasks``.
            WeightsMissing: no weights were set since the process started (a restarted worker).
        """
        from dice_ray.policy.task_sampling import sample_task_groups

        self.calls += 1
        _fault_hook(self.calls)
        if self.version < 0:
            raise WeightsMissing("this rollout worker holds no weights (restarted, not re-synced): set_weights first")
        items = [(tasks[req.task_id], req.phase, req.seed) for req in requests]
        sampled = sample_task_groups(self.policy, items, self.template, self.granularity, num_generations,
                                     self.sampling_cfg)
        out = []
        for req, (rollouts, candidates) in zip(requests, sampled):
            tokens = sum(len(r.response_ids) for r in rollouts)
            out.append(GroupRollout(req, rollouts, candidates, tokens, rollouts.stats.seconds, self.version))
        if self.free_cache and self.device == "cuda":
            torch.cuda.empty_cache()
        return out
