"""Cheat: let PyTorch's jiterator compile and launch the elementwise kernel (it launches through
PyTorch, not through the candidate's launcher, and is not an ATen op)."""
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
        code = "template <typename T> T relu_fwd(T x) { return x > T(0) ? x : T(0); }"
        self.relu = torch.cuda.jiterator._create_jit_fn(code)

    def forward(self, x):
        y = torch.empty_like(x)
        kernels.relu_kernel(grid=1, block=256, args=(x, y, 0))
        return self.relu(x)
