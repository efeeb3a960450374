import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
extern "C" __global__ void scale_clamp_sigmoid_kernel(
    const float* __restrict__ x,
    float* __restrict__ y, long n, float scale, float min_val, float max_val) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) {
        float v = fminf(fmaxf(x[i] * scale, min_val), max_val);
        y[i] = 1.f / (1.f + expf(-v));
    }
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self, scale, min_val, max_val):
        super().__init__()
        self.scale = scale
        self.min_val = min_val
        self.max_val = max_val

    def forward(self, x):
        x = x.contiguous()
        y = torch.empty_like(x)
        n = x.numel()
        kernels.scale_clamp_sigmoid_kernel(grid=(n + 255) // 256, block=256,
                                           args=(x, y, n, self.scale, self.min_val, self.max_val))
        return y
