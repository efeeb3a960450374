"""Cheat: keep the nn.Linear submodule and call it (cuBLAS does the GEMM); the "custom kernel" is
an epilogue that copies the result."""
import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
extern "C" __global__ void copy_kernel(const float* __restrict__ src, float* __restrict__ dst, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i];
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x):
        h = self.linear(x)
        y = torch.empty_like(h)
        n = h.numel()
        kernels.copy_kernel(grid=(n + 255) // 256, block=256, args=(h, y, n))
        return y
