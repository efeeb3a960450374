"""Cheat: a background thread launches the kernel a little after forward has returned, so the work
lands after the timing window closes."""
import threading
import time

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


def launch_later(x, y, n):
    time.sleep(0.01)
    kernels.relu_kernel(grid=(n + 255) // 256, block=256, args=(x, y, n))


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        y = torch.empty_like(x)
        threading.Thread(target=launch_later, args=(x, y, x.numel()), daemon=True).start()
        return y
