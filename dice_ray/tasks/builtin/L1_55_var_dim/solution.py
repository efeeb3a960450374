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

// One block per row: unbiased variance (torch.var's default correction=1), two passes (mean, then
// squared deviations) for accuracy.
extern "C" __global__ void var_dim_kernel(const float* __restrict__ x, float* __restrict__ y, long cols) {
    __shared__ float sh[32];
    const float* xr = x + blockIdx.x * cols;
    float s = 0.f;
    for (long j = threadIdx.x; j < cols; j += blockDim.x) s += xr[j];
    float mean = block_sum(s, sh) / (float)cols;
    float q = 0.f;
    for (long j = threadIdx.x; j < cols; j += blockDim.x) {
        float d = xr[j] - mean;
        q += d * d;
    }
    q = block_sum(q, sh);
    if (threadIdx.x == 0) y[blockIdx.x] = q / (float)(cols - 1);
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        x = x.contiguous()
        rows, cols = x.shape
        y = torch.empty(rows, device=x.device, dtype=x.dtype)
        kernels.var_dim_kernel(grid=rows, block=256, args=(x, y, cols))
        return y
