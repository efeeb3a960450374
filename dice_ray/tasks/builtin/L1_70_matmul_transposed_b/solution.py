import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
#define TILE 16

// C[m, n] = sum_k A[m, k] * B[n, k] (B given row-major [N, K], used transposed).
// Block (TILE, TILE), grid (ceil(N / TILE), ceil(M / TILE)).
extern "C" __global__ void matmul_tb_kernel(const float* __restrict__ A, const float* __restrict__ B,
                                            float* __restrict__ C, long M, long N, long K) {
    __shared__ float As[TILE][TILE];
    __shared__ float Bs[TILE][TILE + 1];
    long row = blockIdx.y * (long)TILE + threadIdx.y;
    long col = blockIdx.x * (long)TILE + threadIdx.x;
    long brow = blockIdx.x * (long)TILE + threadIdx.y;  // the B row this thread loads
    float acc = 0.f;
    for (long t = 0; t < K; t += TILE) {
        long k = t + threadIdx.x;
        As[threadIdx.y][threadIdx.x] = (row < M && k < K) ? A[row * K + k] : 0.f;
        Bs[threadIdx.y][threadIdx.x] = (brow < N && k < K) ? B[brow * K + k] : 0.f;
        __syncthreads();
        for (int kk = 0; kk < TILE; ++kk) acc += As[threadIdx.y][kk] * Bs[threadIdx.x][kk];
        __syncthreads();
    }
    if (row < M && col < N) C[row * N + col] = acc;
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a, b):
        a = a.contiguous()
        b = b.contiguous()
        M, K = a.shape
        N = b.shape[0]
        c = torch.empty(M, N, device=a.device, dtype=a.dtype)
        kernels.matmul_tb_kernel(grid=((N + 15) // 16, (M + 15) // 16), block=(16, 16), args=(a, b, c, M, N, K))
        return c
