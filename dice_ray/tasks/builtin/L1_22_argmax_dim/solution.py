import math

import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
// One thread per output element of x viewed as [outer, r, inner], reducing over r.
extern "C" __global__ void argmax_dim_kernel(
    const float* __restrict__ x, long* __restrict__ y, long outer, long r, long inner) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i >= outer * inner) return;
    const float* p = x + (i / inner) * r * inner + i % inner;
    float m = p[0];
    long best = 0;
    for (long j = 1; j < r; ++j) {
        float v = p[j * inner];
        if (v > m) { m = v; best = j; }  // strict: the first maximum wins, as in torch
    }
    y[i] = best;
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
        y = torch.empty([*x.shape[:d], *x.shape[d + 1:]], device=x.device, dtype=torch.int64)
        n = outer * inner
        kernels.argmax_dim_kernel(grid=(n + 255) // 256, block=256, args=(x, y, outer, r, inner))
        return y
