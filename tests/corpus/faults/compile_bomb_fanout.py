"""Fault: a compile bomb within the template depth limit: every level instantiates two new templates,
2^28 distinct instantiations (16 levels already take ~45 s and 1.4 GB in NVRTC): only the compile
time limit stops it (timeout)."""
import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
template <int N, long M> struct Fan {
    static constexpr long value = Fan<N - 1, 2 * M>::value + Fan<N - 1, 2 * M + 1>::value;
};
template <long M> struct Fan<0, M> { static constexpr long value = M; };

extern "C" __global__ void relu_kernel(const float* __restrict__ x, float* __restrict__ y, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] > 0.f ? x[i] : 0.f * Fan<28, 1>::value;
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
