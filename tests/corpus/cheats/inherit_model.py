"""Cheat: copy the reference class and inherit from it; the kernel runs, then the reference's own
forward is applied on top "as a safety net" (relu(relu(x)) == relu(x))."""
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


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.relu(x)


class ModelNew(Model):
    def forward(self, x):
        y = torch.empty_like(x)
        n = x.numel()
        kernels.relu_kernel(grid=(n + 255) // 256, block=256, args=(x, y, n))
        return super().forward(y)
