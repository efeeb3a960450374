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

// One block per row: cos = <a, b> / (max(|a|, eps) * max(|b|, eps)), eps = 1e-8 as in torch.
extern "C" __global__ void cosine_similarity_kernel(const float* __restrict__ a, const float* __restrict__ b,
                                                   float* __restrict__ y, long cols) {
    __shared__ float sh[32];
    const float* ar = a + blockIdx.x * cols;
    const float* br = b + blockIdx.x * cols;
    float ab = 0.f, aa = 0.f, bb = 0.f;
    for (long j = threadIdx.x; j < cols; j += blockDim.x) {
        float u = ar[j], v = br[j];
        ab += u * v;
        aa += u * u;
        bb += v * v;
    }
    ab = block_sum(ab, sh);
    aa = block_sum(aa, sh);
    bb = block_sum(bb, sh);
    if (threadIdx.x == 0) y[blockIdx.x] = ab / (fmaxf(sqrtf(aa), 1e-8f) * fmaxf(sqrtf(bb), 1e-8f));
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a, b):
        a = a.contiguous()
        b = b.contiguous()
        rows, cols = a.shape
        y = torch.empty(rows, device=a.device, dtype=a.dtype)
        kernels.cosine_similarity_kernel(grid=rows, block=256, args=(a, b, y, cols))
        return y
