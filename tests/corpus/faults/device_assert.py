"""A device-side assert that would fail (assert(x[i] < 0) on normal random inputs): kernels are
built with -DNDEBUG, so it compiles to nothing and the kernel's zeros are judged (incorrect)."""
import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
extern "C" __global__ void relu_kernel(const float* __restrict__ x, float* __restrict__ y, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    assert(x[i] < 0.f);
    y[i] = 0.f;
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        y = torch.empty_like(x)
        n = x.numel()
        kernels.relu_kernel(grid=(n + 255) // 256, block=256, args=(x, y, n))
        return y
