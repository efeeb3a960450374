"""Cheat: launch on a side stream without waiting for the launching stream (the inputs are ready
before the window), so its kernel runs beside the GPU spin that precedes the window's start event: a
timer whose spin leaves SMs free (one spinning thread, as torch.cuda._sleep) times none of it, by CUDA
events or by the host clock alike."""
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
        y = torch.empty_like(x)
        n = x.numel()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            kernels.relu_kernel(grid=(n + 255) // 256, block=256, args=(x, y, n))
        return y
