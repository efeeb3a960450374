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

// One block per row: y[m] = sum_k A[m, k] * x[k].
extern "C" __global__ void matvec_kernel(const float* __restrict__ A, const float* __restrict__ x,
                                        float* __restrict__ y, long K) {
    __shared__ float sh[32];
    const float* a = A + blockIdx.x * K;
    float s = 0.f;
    for (long k = threadIdx.x; k < K; k += blockDim.x) s += a[k] * x[k];
    s = block_sum(s, sh);
    if (threadIdx.x == 0) y[blockIdx.x] = s;
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, A, B):
        A = A.contiguous()
        B = B.contiguous()
        M, K = A.shape
        y = torch.empty(M, 1, device=A.device, dtype=A.dtype)
        kernels.matvec_kernel(grid=M, block=256, args=(A, B, y, K))
        return y
