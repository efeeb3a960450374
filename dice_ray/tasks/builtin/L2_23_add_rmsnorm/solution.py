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

// One block per row: h = x + r, y = h * rsqrt(mean(h^2) + eps) * w (RMSNorm, Zhang & Sennrich 2019).
extern "C" __global__ void add_rmsnorm_kernel(const float* __restrict__ x, const float* __restrict__ r,
                                              const float* __restrict__ w, float* __restrict__ y, long cols,
                                              float eps) {
    __shared__ float sh[32];
    long base = blockIdx.x * cols;
    float q = 0.f;
    for (long j = threadIdx.x; j < cols; j += blockDim.x) {
        float h = x[base + j] + r[base + j];
        q += h * h;
    }
    float inv = rsqrtf(block_sum(q, sh) / (float)cols + eps);
    for (long j = threadIdx.x; j < cols; j += blockDim.x) y[base + j] = (x[base + j] + r[base + j]) * inv * w[j];
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, residual):
        x = x.contiguous()
        residual = residual.contiguous()
        cols = x.shape[-1]
        rows = x.numel() // cols
        y = torch.empty_like(x)
        kernels.add_rmsnorm_kernel(grid=rows, block=256, args=(x, residual, self.weight, y, cols, self.eps))
        return y
