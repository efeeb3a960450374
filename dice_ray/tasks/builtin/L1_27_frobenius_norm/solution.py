import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
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

// Pass 1: per-block partial sums of squares (grid-stride).
extern "C" __global__ void sumsq_partial_kernel(const float* __restrict__ x, float* __restrict__ partial, long n) {
    __shared__ float sh[32];
    float s = 0.f;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        s += x[i] * x[i];
    s = block_sum(s, sh);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// Pass 2: one block turns the partials into the norm.
extern "C" __global__ void norm_finish_kernel(const float* __restrict__ partial, float* __restrict__ norm, long parts) {
    __shared__ float sh[32];
    float s = 0.f;
    for (long i = threadIdx.x; i < parts; i += blockDim.x) s += partial[i];
    s = block_sum(s, sh);
    if (threadIdx.x == 0) norm[0] = sqrtf(s);
}

// Pass 3: divide every element by the norm.
extern "C" __global__ void divide_kernel(const float* __restrict__ x, const float* __restrict__ norm,
                                         float* __restrict__ y, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] / norm[0];
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        x = x.contiguous()
        n = x.numel()
        parts = 1024
        partial = torch.empty(parts, device=x.device, dtype=x.dtype)
        norm = torch.empty(1, device=x.device, dtype=x.dtype)
        y = torch.empty_like(x)
        kernels.sumsq_partial_kernel(grid=parts, block=256, args=(x, partial, n))
        kernels.norm_finish_kernel(grid=1, block=256, args=(partial, norm, parts))
        kernels.divide_kernel(grid=(n + 255) // 256, block=256, args=(x, norm, y, n))
        return y
