import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
extern "C" __global__ void softmax_kernel(const float* __restrict__ x, float* __restrict__ y, long rows, long cols) {
    long r = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* xr = x + r * cols;
    float* yr = y + r * cols;
    float m = __int_as_float(0xff800000);  // -inf
    for (long j = 0; j < cols; ++j) m = fmaxf(m, xr[j]);
    float s = 0.f;
    for (long j = 0; j < cols; ++j) s += expf(xr[j] - m);
    float inv = 1.f / s;
    for (long j = 0; j < cols; ++j) yr[j] = expf(xr[j] - m) * inv;
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
        kernels.softmax_kernel(grid=(rows + 255) // 256, block=256, args=(x, y, rows, cols))
        return y
