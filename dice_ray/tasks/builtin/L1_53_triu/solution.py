import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
// x viewed as [batch, rows, cols]: keep x[b, r, c] where c - r >= diagonal, else 0 (torch.triu).
extern "C" __global__ void triu_kernel(const float* __restrict__ x, float* __restrict__ y, long n, long rows,
                                       long cols, long diagonal) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) {
        long c = i % cols;
        long r = (i / cols) % rows;
        y[i] = c - r >= diagonal ? x[i] : 0.f;
    }
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self, diagonal):
        super().__init__()
        self.diagonal = diagonal

    def forward(self, x):
        x = x.contiguous()
        y = torch.empty_like(x)
        n = x.numel()
        rows, cols = x.shape[-2], x.shape[-1]
        kernels.triu_kernel(grid=(n + 255) // 256, block=256, args=(x, y, n, rows, cols, self.diagonal))
        return y
