import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
#define TILE 16

// C[m, n] = scale * sum_k A[m, k] * B[k, n]; A [M, K], B [K, N] row-major.
// Block (TILE, TILE), grid (ceil(N / TILE), ceil(M / TILE)).
extern "C" __global__ void matmul_scale_kernel(const float* __restrict__ A, const float* __restrict__ B,
                                               float* __restrict__ C, long M, long N, long K, float scale) {
    __shared__ float As[TILE][TILE];
    __shared__ float Bs[TILE][TILE];
    long row = blockIdx.y * (long)TILE + threadIdx.y;
    long col = blockIdx.x * (long)TILE + threadIdx.x;
    float acc = 0.f;
    for (long t = 0; t < K; t += TILE) {
        long ka = t + threadIdx.x, kb = t + threadIdx.y;
        As[threadIdx.y][threadIdx.x] = (row < M && ka < K) ? A[row * K + ka] : 0.f;
        Bs[threadIdx.y][threadIdx.x] = (kb < K && col < N) ? B[kb * N + col] : 0.f;
        __syncthreads();
        for (int kk = 0; kk < TILE; ++kk) acc += As[threadIdx.y][kk] * Bs[kk][threadIdx.x];
        __syncthreads();
    }
    if (row < M && col < N) C[row * N + col] = acc * scale;
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
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, a, b):
        a = a.contiguous()
        b = b.contiguous()
        M, K = a.shape
        N = b.shape[1]
        h = torch.empty(M, N, device=a.device, dtype=a.dtype)
        kernels.matmul_scale_kernel(grid=((N + 15) // 16, (M + 15) // 16), block=(16, 16),
                                    args=(a, b, h, M, N, K, self.scale))
        y = torch.empty_like(h)
        kernels.softmax_kernel(grid=M, block=256, args=(h, y, N))
        return y
