"""The worker's self-test: a built-in relu candidate verified once at start, which warms every path.

A worker that fails a known-good candidate would fail them all (a broken toolkit or settings): it reports
itself failed instead of serving (:mod:`dice_ray.verify.sandbox.worker`).
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["SelfTest"]

_SELF_TEST_REFERENCE = """
import torch
import torch.nn as nn
class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)
def get_inputs():
    return [torch.randn(4096)]
def get_init_inputs():
    return []
"""
_SELF_TEST_CANDIDATE = '''
import torch
import torch.nn as nn
from dice_ray.launch import load_cuda
kernels = load_cuda(r"""
extern "C" __global__ void relu_kernel(const float* x, float* y, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] > 0.f ? x[i] : 0.f;
}
""")
class ModelNew(nn.Module):
    def forward(self, x):
        y = torch.empty_like(x)
        kernels.relu_kernel((x.numel() + 255) // 256, 256, (x, y, x.numel()))
        return y
'''


class SelfTest:
    """The self-test, a part of :class:`~dice_ray.verify.trials.harness.Harness` (its ``settings``, ``jobs`` and
    ``run``)."""

    def self_test(self, stage: Callable[..., Any] = lambda *_a, **_k: None, timing: bool = True) -> str:
        """Verify a built-in relu candidate once (warms every path); returns its verdict and reason.
        ``stage`` is the job's stage callback (the worker's start takes the GPU gate through it);
        ``timing=False`` stops after the correctness trial (no exclusive stage)."""
        saved = dict(self.settings)
        self.settings.update(timing_trials=3, warmup=1, correctness_trials=1, self_test_timing=timing)
        try:
            r = self.run({"candidate_src": _SELF_TEST_CANDIDATE, "reference_src": _SELF_TEST_REFERENCE,
                          "kernel_refs": {"kernels": ["relu_kernel"]}}, stage)
        finally:
            self.settings.clear()
            self.settings.update(saved)
            self.jobs = 0
        return f"{r.verdict}: {r.reason[:300]}"
