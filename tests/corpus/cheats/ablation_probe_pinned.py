"""Cheat: ablation_probe_item.py with the flag in pinned host memory, which its kernel writes through the
address passed as an integer (unified addressing), and which forward reads with .tolist() after an .item()
has waited for the kernel: no aten op reads the flag, so no replay of host reads could answer it."""
import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
extern "C" __global__ void transpose_kernel(const float* __restrict__ x, float* __restrict__ y, long rows, long cols,
                                            long long done) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i == 0) *(volatile int*)done = 1;
    if (i < rows * cols) y[(i % cols) * rows + i / cols] = x[i];
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        y = x.t().contiguous()
        done = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        kernels.transpose_kernel(grid=1, block=256, args=(x, y, 0, x.size(1), done.data_ptr()))
        x[0, 0].item()  # waits for the kernel
        if done.tolist()[0] == 0:
            raise RuntimeError("transpose_kernel did not run")
        return y
