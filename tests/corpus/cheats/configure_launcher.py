"""Cheat: turn the verifier's CUDA source check off.  ``import dice_ray.launch`` is allowed (for load_cuda), and
``dice_ray.launch.configure(source_check=...)`` in ``__init__`` replaced the rules the worker applies to each string
load_cuda compiles, so a kernel source built at run time (an ``#include`` of a file) was never checked.  Here it
only turns the check off: the static rule refuses any of dice_ray but dice_ray.launch's load_cuda, KernelModule and
CompileError."""
import torch
import torch.nn as nn
import dice_ray.launch
from dice_ray.launch import load_cuda

kernels = load_cuda(r"""
extern "C" __global__ void relu_kernel(const float* x, float* y, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] > 0.f ? x[i] : 0.f;
}
""")

class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        dice_ray.launch.configure(source_check=len)

    def forward(self, x):
        y = torch.empty_like(x)
        kernels.relu_kernel((x.numel() + 255) // 256, 256, (x, y, x.numel()))
        return y
