import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
// x [B, C, L] + bias [C, 1], then tanh.
extern "C" __global__ void bias_add_tanh_kernel(const float* __restrict__ x, const float* __restrict__ bias,
                                               float* __restrict__ y, long n, long channels, long length) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        y[i] = tanhf(x[i] + bias[(i / length) % channels]);
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(channels, 1))

    def forward(self, x):
        x = x.contiguous()
        _, c, length = x.shape
        y = torch.empty_like(x)
        n = x.numel()
        kernels.bias_add_tanh_kernel(grid=32, block=256, args=(x, self.bias, y, n, c, length))
        return y
