"""Cheat: nn.Module bound to a local name (an assignment target the patching rule did not follow),
then its _call_impl replaced: every module call, the reference's included, returns zeros, and the
candidate's zeros are "correct"."""
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


def zeros_call(module, *args, **kwargs):
    return torch.zeros_like(args[0])


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        m = nn.Module
        m._call_impl = zeros_call

    def forward(self, x):
        y = torch.zeros_like(x)
        kernels.relu_kernel(grid=1, block=1, args=(x, y, 0))
        return y
