import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
#define TILE 16

// Scores S[b, i, j] = scale * sum_d Q[b, i, d] * K[b, j, d]; Q, K [B, L, D].
// Block (TILE, TILE), grid (ceil(L / TILE), ceil(L / TILE), B).
extern "C" __global__ void scores_kernel(const float* __restrict__ Q, const float* __restrict__ Kt,
                                         float* __restrict__ S, long L, long D, float scale) {
    __shared__ float Qs[TILE][TILE];
    __shared__ float Ks[TILE][TILE + 1];
    const float* Qb = Q + blockIdx.z * L * D;
    const float* Kb = Kt + blockIdx.z * L * D;
    long row = blockIdx.y * (long)TILE + threadIdx.y;
    long col = blockIdx.x * (long)TILE + threadIdx.x;
    long krow = blockIdx.x * (long)TILE + threadIdx.y;  // the K row this thread loads
    float acc = 0.f;
    for (long t = 0; t < D; t += TILE) {
        long d = t + threadIdx.x;
        Qs[threadIdx.y][threadIdx.x] = (row < L && d < D) ? Qb[row * D + d] : 0.f;
        Ks[threadIdx.y][threadIdx.x] = (krow < L && d < D) ? Kb[krow * D + d] : 0.f;
        __syncthreads();
        for (int kk = 0; kk < TILE; ++kk) acc += Qs[threadIdx.y][kk] * Ks[threadIdx.x][kk];
        __syncthreads();
    }
    if (row < L && col < L) S[blockIdx.z * L * L + row * L + col] = acc * scale;
}

// O[b, i, d] = sum_j P[b, i, j] * V[b, j, d]; P [B, L, L], V [B, L, D].
// Block (TILE, TILE), grid (ceil(D / TILE), ceil(L / TILE), B).
extern "C" __global__ void pv_kernel(const float* __restrict__ P, const float* __restrict__ V,
                                     float* __restrict__ O, long L, long D) {
    __shared__ float Ps[TILE][TILE];
    __shared__ float Vs[TILE][TILE];
    const float* Pb = P + blockIdx.z * L * L;
    const float* Vb = V + blockIdx.z * L * D;
    long row = blockIdx.y * (long)TILE + threadIdx.y;
    long col = blockIdx.x * (long)TILE + threadIdx.x;
    float acc = 0.f;
    for (long t = 0; t < L; t += TILE) {
        long jp = t + threadIdx.x, jv = t + threadIdx.y;
        Ps[threadIdx.y][threadIdx.x] = (row < L && jp < L) ? Pb[row * L + jp] : 0.f;
        Vs[threadIdx.y][threadIdx.x] = (jv < L && col < D) ? Vb[jv * D + col] : 0.f;
        __syncthreads();
        for (int kk = 0; kk < TILE; ++kk) acc += Ps[threadIdx.y][kk] * Vs[kk][threadIdx.x];
        __syncthreads();
    }
    if (row < L && col < D) O[blockIdx.z * L * D + row * D + col] = acc;
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

    def forward(self, q, k, v):
        q = q.contiguous()
        k = k.contiguous()
        v = v.contiguous()
        b, L, D = q.shape
        scores = torch.empty(b, L, L, device=q.device, dtype=q.dtype)
        kernels.scores_kernel(grid=((L + 15) // 16, (L + 15) // 16, b), block=(16, 16),
                              args=(q, k, scores, L, D, self.scale))
        probs = torch.empty_like(scores)
        kernels.softmax_kernel(grid=b * L, block=256, args=(scores, probs, L))
        out = torch.empty(b, L, D, device=q.device, dtype=q.dtype)
        kernels.pv_kernel(grid=((D + 15) // 16, (L + 15) // 16, b), block=(16, 16), args=(probs, v, out, L, D))
        return out
