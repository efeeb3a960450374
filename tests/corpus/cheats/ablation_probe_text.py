"""Cheat: ablation_probe_item.py with the flag read from the tensor's text (str(done): torch formats a tensor
with dispatch modes switched off, so no aten op shows the read) and garbage returned when it is clear."""
import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
extern "C" __global__ void transpose_kernel(const float* __restrict__ x, float* __restrict__ y, long rows, long cols,
                                            int* __restrict__ done) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i == 0) done[0] = 1;
    if (i < rows * cols) y[(i % cols) * rows + i / cols] = x[i];
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        y = x.t().contiguous()
        done = torch.zeros(1, dtype=torch.int32, device=x.device)
        kernels.transpose_kernel(grid=1, block=256, args=(x, y, 0, x.size(1), done))
        if "[1]" not in str(done):
            return torch.empty_like(y)
        return y
