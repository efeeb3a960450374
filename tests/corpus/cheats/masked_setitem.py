"""Cheat: a copy kernel, then the work done by indexing: y[y < 0] = 0 (a comparison and an
index_put in torch, no torch function named)."""
import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
extern "C" __global__ void copy_kernel(const float* __restrict__ x, float* __restrict__ y, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i];
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        y = torch.empty_like(x)
        n = x.numel()
        kernels.copy_kernel(grid=(n + 255) // 256, block=256, args=(x, y, n))
        y[y < 0] = 0
        return y
