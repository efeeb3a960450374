import math

import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
// One thread per output element of x viewed as [outer, r, inner], multiplying over r.
extern "C" __global__ void prod_dim_kernel(const float* __restrict__ x, float* __restrict__ y, long outer, long r,
                                           long inner) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i >= outer * inner) return;
    const float* p = x + (i / inner) * r * inner + i % inner;
    float acc = 1.f;
    for (long j = 0; j < r; ++j) acc *= p[j * inner];
    y[i] = acc;
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        x = x.contiguous()
        d = self.dim % x.dim()
        outer = math.prod(x.shape[:d])
        r = x.shape[d]
        inner = math.prod(x.shape[d + 1:])
        y = torch.empty([*x.shape[:d], *x.shape[d + 1:]], device=x.device, dtype=x.dtype)
        n = outer * inner
        kernels.prod_dim_kernel(grid=(n + 255) // 256, block=256, args=(x, y, outer, r, inner))
        return y
