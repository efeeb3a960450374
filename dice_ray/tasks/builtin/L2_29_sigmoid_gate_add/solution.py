import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
// y = a * sigmoid(b) + c, one thread per element.
extern "C" __global__ void sigmoid_gate_add_kernel(const float* __restrict__ a, const float* __restrict__ b,
                                                   const float* __restrict__ c, float* __restrict__ y, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = a[i] / (1.f + expf(-b[i])) + c[i];
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a, b, c):
        a = a.contiguous()
        b = b.contiguous()
        c = c.contiguous()
        y = torch.empty_like(a)
        n = a.numel()
        kernels.sigmoid_gate_add_kernel(grid=(n + 255) // 256, block=256, args=(a, b, c, y, n))
        return y
