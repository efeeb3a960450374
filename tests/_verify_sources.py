"""Shared candidate / reference sources for the verifier tests (fast candidate format)."""

RELU_REF = '''
import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.relu(x)

def get_inputs():
    return [torch.randn(1024, 1024)]

def get_init_inputs():
    return []
'''

TINY_REF = '''
import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return x * 1e-3

def get_inputs():
    return [torch.randn(1024, 1024)]

def get_init_inputs():
    return []
'''

HONEST = '''
import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
extern "C" __global__ void relu_kernel(const float* __restrict__ x, float* __restrict__ y, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] > 0.f ? x[i] : 0.f;
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        x = x.contiguous()
        y = torch.empty_like(x)
        n = x.numel()
        kernels.relu_kernel(grid=(n + 255) // 256, block=256, args=(x, y, n))
        return y
'''


def mutate(old: str, new: str, src: str = HONEST) -> str:
    """``src`` with ``old`` replaced by ``new`` (asserting ``old`` occurs)."""
    assert old in src, old
    return src.replace(old, new)


def with_kernel(body: str, forward_tail: str = "") -> str:
    """HONEST with the kernel body replaced (``i`` and ``n`` in scope)."""
    src = mutate("if (i < n) y[i] = x[i] > 0.f ? x[i] : 0.f;", body)
    return src
