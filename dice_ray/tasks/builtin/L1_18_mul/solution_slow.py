import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
extern "C" __global__ void mul_kernel(const float* __restrict__ a, const float* __restrict__ b,
                                   float* __restrict__ out, long n) {
    long start = (blockIdx.x * (long)blockDim.x + threadIdx.x) * 64;
    for (long i = start; i < start + 64 && i < n; ++i) out[i] = a[i] * b[i];
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a, b):
        a = a.contiguous()
        b = b.contiguous()
        out = torch.empty_like(a)
        n = a.numel()
        kernels.mul_kernel(grid=(n + 64 * 256 - 1) // (64 * 256), block=256, args=(a, b, out, n))
        return out
