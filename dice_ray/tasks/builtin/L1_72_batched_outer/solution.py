import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
// Batched outer product y[b, i, j] = a[b, i] * b[b, j]; one thread per output element.
extern "C" __global__ void batched_outer_kernel(const float* __restrict__ a, const float* __restrict__ b,
                                                float* __restrict__ y, long n, long M, long N) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) {
        long col = i % N;
        long row = i / N;  // = batch * M + m, which is also a's flat index
        y[i] = a[row] * b[(row / M) * N + col];
    }
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a, b):
        a = a.contiguous()
        b = b.contiguous()
        batch, M = a.shape
        N = b.shape[1]
        y = torch.empty(batch, M, N, device=a.device, dtype=a.dtype)
        n = batch * M * N
        kernels.batched_outer_kernel(grid=(n + 255) // 256, block=256, args=(a, b, y, n, M, N))
        return y
