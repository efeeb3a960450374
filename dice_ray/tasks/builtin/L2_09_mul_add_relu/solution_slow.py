import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
extern "C" __global__ void mul_add_relu_kernel(
    const float* __restrict__ a, const float* __restrict__ b, const float* __restrict__ c,
    float* __restrict__ y, long n) {
    long start = (blockIdx.x * (long)blockDim.x + threadIdx.x) * 64;
    for (long i = start; i < start + 64 && i < n; ++i) {
        float v = a[i] * b[i] + c[i];
        y[i] = v > 0.f ? v : 0.f;
    }
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a, b, c):
        a = a.contiguous()
        b = b.contiguous()
        c = c.contiguous()
        y = torch.empty_like(a)
        n = a.numel()
        kernels.mul_add_relu_kernel(grid=(n + 64 * 256 - 1) // (64 * 256), block=256, args=(a, b, c, y, n))
        return y
