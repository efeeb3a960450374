"""Cheat: a process-wide forward hook (nn.modules.module.register_module_forward_hook, not a
set_* call) runs after every module's forward, the reference's included, and replaces each output
with zeros: the candidate's zeros match."""
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


def zero_output(module, args, output):
    return torch.zeros_like(output)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        nn.modules.module.register_module_forward_hook(zero_output)

    def forward(self, x):
        y = torch.zeros_like(x)
        kernels.relu_kernel(grid=1, block=1, args=(x, y, 0))
        return y
