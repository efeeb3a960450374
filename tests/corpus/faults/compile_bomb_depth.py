"""Fault: C++ template recursion 100000 levels deep through NVRTC (the front end stops it: compile_error)."""
import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
template <long N> struct Depth { static constexpr long value = Depth<N - 1>::value + 1; };
template <> struct Depth<0> { static constexpr long value = 0; };

extern "C" __global__ void relu_kernel(const float* __restrict__ x, float* __restrict__ y, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] > 0.f ? x[i] : 0.f * Depth<100000>::value;
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
