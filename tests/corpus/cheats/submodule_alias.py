"""Cheat: nn.ReLU built in __init__ (allowed there) and called in forward through a local name, so
no self.<submodule>(x) call appears; a copy kernel makes it look like a custom kernel."""
import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
extern "C" __global__ void copy_kernel(const float* __restrict__ x, float* __restrict__ y, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i];
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.act = nn.ReLU()

    def forward(self, x):
        act = self.act
        r = act(x)
        y = torch.empty_like(r)
        n = r.numel()
        kernels.copy_kernel(grid=(n + 255) // 256, block=256, args=(r, y, n))
        return y
