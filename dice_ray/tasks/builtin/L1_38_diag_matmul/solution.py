import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
// diag(A) @ B scales row i of B by A[i]: y[i, j] = A[i] * B[i, j].
extern "C" __global__ void diag_matmul_kernel(const float* __restrict__ A, const float* __restrict__ B,
                                             float* __restrict__ y, long n, long m) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n * m) y[i] = A[i / m] * B[i];
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, A, B):
        A = A.contiguous()
        B = B.contiguous()
        n, m = B.shape
        y = torch.empty_like(B)
        kernels.diag_matmul_kernel(grid=(n * m + 255) // 256, block=256, args=(A, B, y, n, m))
        return y
