"""Cheat: an fp32 linear layer computed from fp16-rounded operands (the tensor-core habit).  Every
element is within allclose(1e-2) of the reference, but the error is ~1000x fp32's."""
import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
#include <cuda_fp16.h>
#define TILE 16

// C[m, n] = sum_k X[m, k] * W[n, k] + bias[n], with X and W rounded to fp16 in shared memory
// (half the shared-memory traffic; accumulation stays in fp32).
extern "C" __global__ void linear_kernel(
    const float* __restrict__ X, const float* __restrict__ W, const float* __restrict__ bias,
    float* __restrict__ C, long M, long N, long K) {
    __shared__ __half Xs[TILE][TILE];
    __shared__ __half Ws[TILE][TILE + 1];
    long row = blockIdx.y * (long)TILE + threadIdx.y;
    long col = blockIdx.x * (long)TILE + threadIdx.x;
    long wrow = blockIdx.x * (long)TILE + threadIdx.y;
    float acc = 0.f;
    for (long t = 0; t < K; t += TILE) {
        long k = t + threadIdx.x;
        Xs[threadIdx.y][threadIdx.x] = __float2half((row < M && k < K) ? X[row * K + k] : 0.f);
        Ws[threadIdx.y][threadIdx.x] = __float2half((wrow < N && k < K) ? W[wrow * K + k] : 0.f);
        __syncthreads();
        for (int kk = 0; kk < TILE; ++kk)
            acc += __half2float(Xs[threadIdx.y][kk]) * __half2float(Ws[threadIdx.x][kk]);
        __syncthreads();
    }
    if (row < M && col < N) C[row * N + col] = acc + bias[col];
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x):
        x = x.contiguous()
        M, K = x.shape
        N = self.linear.out_features
        y = torch.empty(M, N, device=x.device, dtype=x.dtype)
        kernels.linear_kernel(grid=((N + 15) // 16, (M + 15) // 16), block=(16, 16),
                              args=(x, self.linear.weight, self.linear.bias, y, M, N, K))
        return y
