"""Cheat: a data-movement task answered by torch's copy ops, which forward may run (x.t().contiguous():
launch code calls .contiguous() all the time), next to a launch of the candidate's own transpose kernel
over zero elements, so every call launches a kernel and nothing is computed by it."""
import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
extern "C" __global__ void transpose_kernel(const float* __restrict__ x, float* __restrict__ y, long rows, long cols) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < rows * cols) y[(i % cols) * rows + i / cols] = x[i];
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        y = x.t().contiguous()
        kernels.transpose_kernel(grid=1, block=256, args=(x, y, 0, x.size(1)))
        return y
