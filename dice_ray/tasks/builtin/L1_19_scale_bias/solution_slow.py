import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
extern "C" __global__ void scale_bias_kernel(const float* __restrict__ x, float* __restrict__ y, long n,
                                             float scale, float bias) {
    long start = (blockIdx.x * (long)blockDim.x + threadIdx.x) * 64;
    for (long i = start; i < start + 64 && i < n; ++i) y[i] = x[i] * scale + bias;
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self, scale, bias):
        super().__init__()
        self.scale = scale
        self.bias = bias

    def forward(self, x):
        x = x.contiguous()
        y = torch.empty_like(x)
        n = x.numel()
        kernels.scale_bias_kernel(grid=(n + 64 * 256 - 1) // (64 * 256), block=256, args=(x, y, n, self.scale, self.bias))
        return y
