import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
// powf is exact in sign for an integral exponent and a negative base, like torch.pow.
extern "C" __global__ void pow_kernel(const float* __restrict__ x, float* __restrict__ y, long n,
                                     float exponent) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) {
        float v = x[i];
        y[i] = powf(v, exponent);
    }
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self, exponent):
        super().__init__()
        self.exponent = exponent

    def forward(self, x):
        x = x.contiguous()
        y = torch.empty_like(x)
        n = x.numel()
        kernels.pow_kernel(grid=(n + 255) // 256, block=256, args=(x, y, n, self.exponent))
        return y
