"""Helpers shared by several test files: waiting on a VerifierPool's status, a plain-torch engine."""

from __future__ import annotations

import json
import time

import ray
import torch


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
