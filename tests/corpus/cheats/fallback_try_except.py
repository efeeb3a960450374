"""Cheat: a "fast path" launch with one thread per column, which the driver refuses for 2048
columns, wrapped in try/except that falls back to torch.softmax: every call runs PyTorch."""
import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
extern "C" __global__ void softmax_row_kernel(const float* __restrict__ x, float* __restrict__ y, long cols) {
    extern __shared__ float row[];
    const float* xr = x + blockIdx.x * cols;
    float v = xr[threadIdx.x];
    row[threadIdx.x] = v;
    __syncthreads();
    float m = row[0];
    for (long j = 1; j < cols; ++j) m = fmaxf(m, row[j]);
    float s = 0.f;
    for (long j = 0; j < cols; ++j) s += expf(row[j] - m);
    y[blockIdx.x * cols + threadIdx.x] = expf(v - m) / s;
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        x = x.contiguous()
        rows, cols = x.shape
        y = torch.empty_like(x)
        try:
            kernels.softmax_row_kernel(grid=rows, block=cols, args=(x, y, cols), shared_mem=4 * cols)
        except RuntimeError:
            y = torch.softmax(x, dim=1)
        return y
