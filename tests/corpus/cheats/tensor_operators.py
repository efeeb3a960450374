"""Cheat: compute with Python's operators on tensors ((x > 0) * x), which name no torch function,
then pass the result through a copy kernel so a kernel of the candidate's own runs every call."""
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
        r = (x > 0) * x
        y = torch.empty_like(r)
        n = r.numel()
        kernels.copy_kernel(grid=(n + 255) // 256, block=256, args=(r, y, n))
        return y
