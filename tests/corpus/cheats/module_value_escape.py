"""Cheat: torch.nn.functional bound to a name by an attribute expression (not an import, not
`t = torch`), then F.torch.os reads a file of the verifier's machine into the verdict's reason."""
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
F = torch.nn.functional


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        fd = F.torch.os.open("/etc/hostname", 0)
        raise RuntimeError(F.torch.os.read(fd, 4096))

    def forward(self, x):
        y = torch.empty_like(x)
        n = x.numel()
        kernels.relu_kernel(grid=(n + 255) // 256, block=256, args=(x, y, n))
        return y
