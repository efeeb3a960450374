import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
// Feature-wise modulation (adaLN-style) + GELU: v = x[r, j] * (1 + scale[j]) + shift[j],
// y = 0.5 v (1 + erf(v / sqrt(2))). One thread per element.
extern "C" __global__ void scale_shift_gelu_kernel(const float* __restrict__ x, const float* __restrict__ scale,
                                                   const float* __restrict__ shift, float* __restrict__ y, long n,
                                                   long dim) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) {
        long j = i % dim;
        float v = x[i] * (1.f + scale[j]) + shift[j];
        y[i] = 0.5f * v * (1.f + erff(v * 0.70710678118654752f));
    }
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(dim) * 0.1)
        self.shift = nn.Parameter(torch.randn(dim) * 0.1)

    def forward(self, x):
        x = x.contiguous()
        y = torch.empty_like(x)
        n = x.numel()
        kernels.scale_shift_gelu_kernel(grid=(n + 255) // 256, block=256,
                                        args=(x, self.scale, self.shift, y, n, x.shape[-1]))
        return y
