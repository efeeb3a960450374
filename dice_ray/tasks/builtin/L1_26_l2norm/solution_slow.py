import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
extern "C" __global__ void l2norm_kernel(const float* __restrict__ x, float* __restrict__ y, long rows, long cols) {
    long r = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* xr = x + r * cols;
    float* yr = y + r * cols;
    float s = 0.f;
    for (long j = 0; j < cols; ++j) s += xr[j] * xr[j];
    float norm = sqrtf(s);
    for (long j = 0; j < cols; ++j) yr[j] = xr[j] / norm;
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        x = x.contiguous()
        cols = x.shape[-1]
        rows = x.numel() // cols
        y = torch.empty_like(x)
        kernels.l2norm_kernel(grid=(rows + 255) // 256, block=256, args=(x, y, rows, cols))
        return y
