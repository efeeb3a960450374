import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
#define TILE 16

// Linear: C[m, n] = epilogue(v), v = sum_k X[m, k] * W[n, k] + bias[n].
// Block (TILE, TILE), grid (ceil(N / TILE), ceil(M / TILE)).
extern "C" __global__ void linear_kernel(
    const float* __restrict__ X, const float* __restrict__ W, const float* __restrict__ bias,
    float* __restrict__ C, long M, long N, long K) {
    __shared__ float Xs[TILE][TILE];
    __shared__ float Ws[TILE][TILE + 1];
    long row = blockIdx.y * (long)TILE + threadIdx.y;
    long col = blockIdx.x * (long)TILE + threadIdx.x;
    long wrow = blockIdx.x * (long)TILE + threadIdx.y;  // the W row this thread loads
    float acc = 0.f;
    for (long t = 0; t < K; t += TILE) {
        long k = t + threadIdx.x;
        Xs[threadIdx.y][threadIdx.x] = (row < M && k < K) ? X[row * K + k] : 0.f;
        Ws[threadIdx.y][threadIdx.x] = (wrow < N && k < K) ? W[wrow * K + k] : 0.f;
        __syncthreads();
        for (int kk = 0; kk < TILE; ++kk) acc += Xs[threadIdx.y][kk] * Ws[threadIdx.x][kk];
        __syncthreads();
    }
    if (row < M && col < N) {
        float v = acc + bias[col];
        C[row * N + col] = v;
    }
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}

// Max over a block of a multiple of 32 threads; every thread gets the result. sh: 32 floats.
__device__ float block_max(float v, float* sh) {
    v = warp_max(v);
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    v = (threadIdx.x & 31) < (blockDim.x >> 5) ? sh[threadIdx.x & 31] : __int_as_float(0xff800000);
    v = warp_max(v);
    __syncthreads();
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}

// Sum over a block of a multiple of 32 threads; every thread gets the result. sh: 32 floats.
__device__ float block_sum(float v, float* sh) {
    v = warp_sum(v);
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    v = (threadIdx.x & 31) < (blockDim.x >> 5) ? sh[threadIdx.x & 31] : 0.f;
    v = warp_sum(v);
    __syncthreads();
    return v;
}

// One block per row: y = softmax(x) over the last dim.
extern "C" __global__ void softmax_kernel(const float* __restrict__ x, float* __restrict__ y, long cols) {
    __shared__ float sh[32];
    const float* xr = x + blockIdx.x * cols;
    float* yr = y + blockIdx.x * cols;
    float m = __int_as_float(0xff800000);  // -inf
    for (long j = threadIdx.x; j < cols; j += blockDim.x) m = fmaxf(m, xr[j]);
    m = block_max(m, sh);
    float s = 0.f;
    for (long j = threadIdx.x; j < cols; j += blockDim.x) s += expf(xr[j] - m);
    float inv = 1.f / block_sum(s, sh);
    for (long j = threadIdx.x; j < cols; j += blockDim.x) yr[j] = expf(xr[j] - m) * inv;
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
        h = torch.empty(M, N, device=x.device, dtype=x.dtype)
        kernels.linear_kernel(grid=((N + 15) // 16, (M + 15) // 16), block=(16, 16),
                              args=(x, self.linear.weight, self.linear.bias, h, M, N, K))
        y = torch.empty_like(h)
        kernels.softmax_kernel(grid=M, block=256, args=(h, y, N))
        return y
