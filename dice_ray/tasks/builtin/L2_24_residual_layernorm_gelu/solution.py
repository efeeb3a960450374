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

// One block per row: h = x + r; v = LayerNorm(h) * w + b (biased variance, two passes);
// y = gelu(v) with the exact erf form 0.5 v (1 + erf(v / sqrt(2))).
extern "C" __global__ void residual_layernorm_gelu_kernel(const float* __restrict__ x, const float* __restrict__ r,
                                                          const float* __restrict__ w, const float* __restrict__ b,
                                                          float* __restrict__ y, long cols, float eps) {
    __shared__ float sh[32];
    long base = blockIdx.x * cols;
    float s = 0.f;
    for (long j = threadIdx.x; j < cols; j += blockDim.x) s += x[base + j] + r[base + j];
    float mean = block_sum(s, sh) / (float)cols;
    float q = 0.f;
    for (long j = threadIdx.x; j < cols; j += blockDim.x) {
        float d = x[base + j] + r[base + j] - mean;
        q += d * d;
    }
    float rstd = rsqrtf(block_sum(q, sh) / (float)cols + eps);
    for (long j = threadIdx.x; j < cols; j += blockDim.x) {
        float v = (x[base + j] + r[base + j] - mean) * rstd * w[j] + b[j];
        y[base + j] = 0.5f * v * (1.f + erff(v * 0.70710678118654752f));
    }
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, residual):
        x = x.contiguous()
        residual = residual.contiguous()
        cols = x.shape[-1]
        rows = x.numel() // cols
        y = torch.empty_like(x)
        kernels.residual_layernorm_gelu_kernel(grid=rows, block=256,
                                               args=(x, residual, self.norm.weight, self.norm.bias, y, cols,
                                                     self.norm.eps))
        return y
