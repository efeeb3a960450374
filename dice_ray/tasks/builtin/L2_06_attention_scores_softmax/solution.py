import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
#define TILE 16

// S[b, i, j] = scale * sum_d Q[b, i, d] * K[b, j, d]; block (TILE, TILE), grid (ceil(L/TILE), ceil(L/TILE), B).
extern "C" __global__ void scores_kernel(const float* __restrict__ Q, const float* __restrict__ K,
                                         float* __restrict__ S, long L, long D, float scale) {
    __shared__ float Qs[TILE][TILE];
    __shared__ float Ks[TILE][TILE + 1];
    Q += blockIdx.z * L * D;
    K += blockIdx.z * L * D;
    S += blockIdx.z * L * L;
    long row = blockIdx.y * (long)TILE + threadIdx.y;
    long col = blockIdx.x * (long)TILE + threadIdx.x;
    long krow = blockIdx.x * (long)TILE + threadIdx.y;
    float acc = 0.f;
    for (long t = 0; t < D; t += TILE) {
        long d = t + threadIdx.x;
        Qs[threadIdx.y][threadIdx.x] = (row < L && d < D) ? Q[row * D + d] : 0.f;
        Ks[threadIdx.y][threadIdx.x] = (krow < L && d < D) ? K[krow * D + d] : 0.f;
        __syncthreads();
        for (int dd = 0; dd < TILE; ++dd) acc += Qs[threadIdx.y][dd] * Ks[threadIdx.x][dd];
        __syncthreads();
    }
    if (row < L && col < L) S[row * L + col] = acc * scale;
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

// In-place softmax of each row of S (one block per row).
extern "C" __global__ void softmax_rows_kernel(float* __restrict__ S, long cols) {
    __shared__ float sh[32];
    float* r = S + blockIdx.x * cols;
    float m = __int_as_float(0xff800000);  // -inf
    for (long j = threadIdx.x; j < cols; j += blockDim.x) m = fmaxf(m, r[j]);
    m = block_max(m, sh);
    float s = 0.f;
    for (long j = threadIdx.x; j < cols; j += blockDim.x) s += expf(r[j] - m);
    float inv = 1.f / block_sum(s, sh);
    for (long j = threadIdx.x; j < cols; j += blockDim.x) r[j] = expf(r[j] - m) * inv;
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, q, k):
        q = q.contiguous()
        k = k.contiguous()
        B, L, D = q.shape
        s = torch.empty(B, L, L, device=q.device, dtype=q.dtype)
        kernels.scores_kernel(grid=((L + 15) // 16, (L + 15) // 16, B), block=(16, 16),
                              args=(q, k, s, L, D, self.scale))
        kernels.softmax_rows_kernel(grid=B * L, block=256, args=(s, L))
        return s
