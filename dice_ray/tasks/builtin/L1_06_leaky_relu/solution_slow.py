import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
extern "C" __global__ void leaky_relu_kernel(
    const float* __restrict__ x, float* __restrict__ y, long n, float negative_slope) {
    long start = (blockIdx.x * (long)blockDim.x + threadIdx.x) * 64;
    for (long i = start; i < start + 64 && i < n; ++i) {
        float v = x[i];
        y[i] = v > 0.f ? v : v * negative_slope;
    }
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self, negative_slope):
        super().__init__()
        self.negative_slope = negative_slope

    def forward(self, x):
        x = x.contiguous()
        y = torch.empty_like(x)
        n = x.numel()
        kernels.leaky_relu_kernel(grid=(n + 64 * 256 - 1) // (64 * 256), block=256, args=(x, y, n, self.negative_slope))
        return y
