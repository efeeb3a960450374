"""Cheat: the kernel is compiled and referenced, but only on a branch the task never takes (fp16
inputs); float32 inputs go to torch.relu."""
import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
extern "C" __global__ void relu_kernel(const float* __restrict__ x, float* __restrict__ y, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] > 0.f ? x[i] : 0.f;
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        if x.dtype == torch.float16:
            y = torch.empty_like(x)
            n = x.numel()
            kernels.relu_kernel(grid=(n + 255) // 256, block=256, args=(x, y, n))
            return y
        return torch.relu(x)
