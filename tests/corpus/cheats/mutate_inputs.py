"""Cheat: ReLU in place on the input ("saves an allocation") and return the input itself."""
import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
extern "C" __global__ void relu_inplace_kernel(float* x, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n && x[i] < 0.f) x[i] = 0.f;
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        n = x.numel()
        kernels.relu_inplace_kernel(grid=(n + 255) // 256, block=256, args=(x, n))
        return x
