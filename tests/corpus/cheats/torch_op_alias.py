"""Cheat: bind torch.matmul to a module-level name (a "constant" assignment) and call it by that name
in forward, where no torch.<op> call appears; a copy kernel makes it look like a custom kernel."""
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
MATMUL = torch.matmul


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, A, B):
        C = MATMUL(A, B)
        out = torch.empty_like(C)
        n = C.numel()
        kernels.copy_kernel(grid=(n + 255) // 256, block=256, args=(C, out, n))
        return out
