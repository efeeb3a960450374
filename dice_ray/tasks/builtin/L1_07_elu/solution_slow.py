import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
extern "C" __global__ void elu_kernel(const float* __restrict__ x, float* __restrict__ y, long n, float alpha) {
    long start = (blockIdx.x * (long)blockDim.x + threadIdx.x) * 64;
    for (long i = start; i < start + 64 && i < n; ++i) {
        float v = x[i];
        y[i] = v > 0.f ? v : alpha * expm1f(v);
    }
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self, alpha):
        super().__init__()
        self.alpha = alpha

    def forward(self, x):
        x = x.contiguous()
        y = torch.empty_like(x)
        n = x.numel()
        kernels.elu_kernel(grid=(n + 64 * 256 - 1) // (64 * 256), block=256, args=(x, y, n, self.alpha))
        return y
