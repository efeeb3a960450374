"""Cheat: transpose_by_copy.py made to see the kernel ablation coming.  Its kernel sets a flag; forward reads
the flag with .item() (allowed: launch code reads sizes and counts back) and raises when it is clear, as it
is when the verifier skips the candidate's kernels, so the ablated call gives no outputs to judge."""
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
        if done.item() == 0:
            raise RuntimeError("transpose_kernel did not run")
        return y
