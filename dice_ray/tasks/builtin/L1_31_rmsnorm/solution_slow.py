import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
// y = x / sqrt(mean(x^2) + eps) * w.
extern "C" __global__ void rmsnorm_kernel(const float* __restrict__ x, const float* __restrict__ w,
                                         float* __restrict__ y, long rows, long cols, float eps) {
    long r = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* xr = x + r * cols;
    float* yr = y + r * cols;
    float s = 0.f;
    for (long j = 0; j < cols; ++j) s += xr[j] * xr[j];
    float rms = sqrtf(s / (float)cols + eps);
    for (long j = 0; j < cols; ++j) yr[j] = xr[j] / rms * w[j];
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x = x.contiguous()
        cols = x.shape[-1]
        rows = x.numel() // cols
        y = torch.empty_like(x)
        kernels.rmsnorm_kernel(grid=(rows + 255) // 256, block=256, args=(x, self.weight, y, rows, cols, self.eps))
        return y
