"""Helpers shared by several test files: a process's state, the session's shared Ray cluster joined for a block, waiting
on a VerifierPool's status, a plain-torch engine, the coupled estimator's exact expectation, ``dice-ray train`` in a
process of its own and the deterministic run's overrides."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Iterator

import pytest
import ray
import torch


TINY_FAMILY_SHAPE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 256, "block_size": 4}
"""ModelConfig fields of the tiny random LLaDA / Dream / SDAR models the family tests build (no download)."""

DETERMINISTIC = [
    "rl.prompts_per_step=2", "rl.num_generations=3", "rl.beta=0.01", "rl.logprob_estimator=coupled",
    "phase.infill_steps=2", "phase.ramp_steps=3",  # steps 0-1 infill, 2-4 ramp (resume at 3), 5 e2e
    "sampling.max_new_tokens=96", "sft.steps=100", "eval.heldout_tasks=0", "eval.train_tasks=1",
    "cluster.num_verifiers=1", "tasks.max_tasks=6",  # 5 training tasks: new epochs at steps 2 and 4
]
"""``dice-ray train`` overrides of a deterministic 6-step CPU run (compile-only verifiers): tests/test_resume_exact.py
makes it straight, then resumes a copy from step 3 with a rollout worker crashing mid-step, to get the same per-step
records."""

TIMING = {
    "learner_step_seconds", "rollout_seconds", "verify_seconds", "learn_seconds", "sync_seconds",
    "rollout_tokens_per_s", "verifier_throughput", "verifier_queue_depth", "verifier_pool_size", "step_seconds",
    # stage timeline figures of dice_ray.cluster.metrics (the asynchronous pipeline)
    "idle_seconds", "checkpoint_seconds", "rollout_busy_share", "verify_busy_share", "learner_busy_share",
    "rollout_learn_overlap_seconds", "timeline", "gpu_busy_share", "gpu_busy_share_mean", "gpu_busy_share_min",
    "rollout_restarts",
}
"""Fields of a step record that are wall-clock figures (or count restarts): the rest must match between two runs of
the deterministic config."""


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def process_state(pid: int, want: str = "", timeout_s: float = 5.0) -> str:
    """The state letter of ``/proc/<pid>/stat`` (``T``: stopped); with ``want``, once it is that (a signal's
    delivery takes a moment) or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        if state == want or not want or time.monotonic() > deadline:
            return state
        time.sleep(0.01)


#: a subprocess's guard against a hang (s), not a speed check: these cores are shared and slow down several-fold
HANG_S = 600


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module (the benchmarks are scripts, not a package), registered in
    ``sys.modules`` under ``name`` unless that name is taken (its dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, mod)
    spec.loader.exec_module(mod)
    return mod


def train_cli(args: list[str], env: dict, timeout: float = 600) -> str:
    """``dice-ray train ARGS`` in a process of its own with ``env``; asserts it exits 0 and returns its stdout."""
    proc = subprocess.run([sys.executable, "-m", "dice_ray.cli", "train", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-4000:]}"
    return proc.stdout


def wait_for_pool(pool, cond, what: str = "condition", timeout: float = 60.0, poll: float = 0.2) -> dict:
    """Poll ``pool.status`` until ``cond(status)`` holds; returns that status.

    Raises:
        AssertionError: ``timeout`` seconds passed first (the message names ``what`` and the last status).
    """
    deadline = time.monotonic() + timeout
    while True:
        status = ray.get(pool.status.remote())
        if cond(status):
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {json.dumps(status, default=str)[:2000]}")
        time.sleep(poll)


@contextmanager
def joined_ray(address: str, namespace: str | None = None, timeout_s: float = 60.0) -> Iterator[None]:
    """This process as a Ray driver of the session's shared cluster (conftest's ``ray_head``) for the block: a Ray job
    of its own in ``namespace``. Joining waits until the cluster holds nothing of an earlier job (the actors and
    placement groups of a job that left end within a second or so); leaving (``ray.shutdown``) ends the job, and with
    it every actor and placement group it made, and leaves the cluster running.

    Raises:
        RuntimeError: something of an earlier job is still there after ``timeout_s`` (the message names it).
    """
    from dice_ray.cluster.auth import connect

    connect(address, namespace=namespace, log_to_driver=False)  # as ``--address``: this machine's token, if any
    try:
        deadline = time.monotonic() + timeout_s
        while left := _left_by_earlier_jobs():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the shared Ray cluster still holds what earlier test modules made, "
                                   f"{timeout_s:.0f} s after this one joined: {left}")
            time.sleep(0.1)
        yield
    finally:
        ray.shutdown()


def _left_by_earlier_jobs() -> list[str]:
    """Actors not dead, placement groups not removed and resources in use, on the cluster this process joined (with no
    dashboard, the GCS's own tables)."""
    from ray._private import state

    left = [f"actor {a['ActorClassName']} {a['Name'] or ''} ({a['State']}, job {a['JobID']})".replace("  ", " ")
            for a in state.actors().values() if a["State"] != "DEAD"]
    left += [f"placement group {pg} ({info['state']})" for pg, info in ray.util.placement_group_table().items()
             if info["state"] != "REMOVED"]
    free = ray.available_resources()
    left += [f"{k} {free.get(k, 0)} of {total} free" for k, total in ray.cluster_resources().items()
             if free.get(k, 0) < total - 1e-6]
    return left


class PlainEngine:
    """The slice of a DeepSpeed engine ``Learner.train_step`` uses, on a plain module and a torch optimizer."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.module, self.opt = module, optimizer

    def train(self):
        self.module.train()

    def set_gradient_accumulation_boundary(self, _flag):
        pass

    def backward(self, loss, scale_wrt_gas=False):
        loss.backward()

    def step(self):
        self.opt.step()
        self.opt.zero_grad()


def coupled_mask_probability(k: int, n: int) -> float:
    """P(one given mask with k of n positions masked) under DiffuCoder's coupled sampling: t ~ U(lo, hi)
    (``COUPLED_MASK_RATIO``), each position masked with probability t; (1 / (hi - lo)) * the integral of
    t^k (1 - t)^(n - k) over [lo, hi], by the binomial expansion."""
    import math

    from dice_ray.policy.logprobs import COUPLED_MASK_RATIO

    lo, hi = COUPLED_MASK_RATIO
    total = sum(math.comb(n - k, j) * (-1) ** j * (hi ** (k + j + 1) - lo ** (k + j + 1)) / (k + j + 1)
                for j in range(n - k + 1))
    return total / (hi - lo)


def coupled_expectation_and_draws(model, prompt, resp, block_size: int, mask_id: int, rows: int = 8, seeds: int = 200):
    """The coupled estimator's exact expectation over all 2^n masks of ``resp`` (LongTensor[1, n]), float64[n],
    and the per-seed means of ``seeds`` draws of ``rows`` rows each, float64[seeds, n] (iid seed means: one
    ratio t a draw)."""
    import itertools

    from dice_ray.policy.logprobs import coupled_logprobs, response_logprobs

    valid = torch.ones_like(resp, dtype=torch.bool)
    n = resp.shape[1]
    expect = torch.zeros(n, dtype=torch.float64)
    total_p = 0.0
    for bits in itertools.product([False, True], repeat=n):
        mask = torch.tensor([bits])
        p = coupled_mask_probability(int(mask.sum()), n)
        total_p += p
        expect += p * coupled_logprobs(model, prompt, resp, valid, block_size, mask_id, mask)[0].double()
    assert abs(total_p - 1.0) < 1e-12
    batch = resp.expand(rows, -1)
    with torch.no_grad():
        draws = torch.stack([
            response_logprobs("coupled", model, prompt, batch, batch * 0, valid.expand(rows, -1), block_size, mask_id,
                              seed=s).mean(0)
            for s in range(seeds)
        ]).double()
    return expect, draws


def saved_activation_bytes(model: torch.nn.Module, fn) -> int:
    """Bytes of the tensors autograd keeps for the backward while ``fn()`` runs (each storage counted once, at its
    largest), the model's parameters left out: what a memory estimate of activations must match."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            saved[s.data_ptr()] = max(saved.get(s.data_ptr(), 0), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(saved.values())


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models: one torch thread (several fight over these shared cores, ~50x slower when loaded). Autouse in a
    test module that imports it (``from _helpers import one_torch_thread``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
