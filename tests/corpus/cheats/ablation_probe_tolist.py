"""Cheat: ablation_probe_item.py with the flag read by done.tolist() on the device tensor (aten _to_copy to
the CPU, not copy_ nor _local_scalar_dense) and garbage returned when it is clear, so the ablated call's outputs
are wrong whenever the verifier skips the kernels."""
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
        if done.tolist()[0] == 0:
            return torch.empty_like(y)
        return y
