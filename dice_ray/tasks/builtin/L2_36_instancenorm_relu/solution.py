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

// InstanceNorm + ReLU.
// One block per group of `count` contiguous elements (an instance-norm plane or a group-norm group):
// mean and biased variance in two passes, then y = (x - mean) * rsqrt(var + eps) * w[ch] + b[ch],
// ch = (group * count + j) / hw % channels (w, b unused when affine == 0).
extern "C" __global__ void instancenorm_relu_kernel(const float* __restrict__ x, const float* __restrict__ w,
                                        const float* __restrict__ b, float* __restrict__ y, long count, long hw,
                                        long channels, int affine, float eps) {
    __shared__ float sh[32];
    long base = blockIdx.x * count;
    const float* xg = x + base;
    float* yg = y + base;
    float s = 0.f;
    for (long j = threadIdx.x; j < count; j += blockDim.x) s += xg[j];
    float mean = block_sum(s, sh) / (float)count;
    float q = 0.f;
    for (long j = threadIdx.x; j < count; j += blockDim.x) {
        float d = xg[j] - mean;
        q += d * d;
    }
    float rstd = rsqrtf(block_sum(q, sh) / (float)count + eps);
    for (long j = threadIdx.x; j < count; j += blockDim.x) {
        float v = (xg[j] - mean) * rstd;
        if (affine) {
            long ch = (base + j) / hw % channels;
            v = v * w[ch] + b[ch];
        }
        y[base + j] = fmaxf(v, 0.f);
    }
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self, num_features):
        super().__init__()
        self.eps = 1e-5  # nn.InstanceNorm2d's default; affine=False, so there are no weights

    def forward(self, x):
        x = x.contiguous()
        n, c, h, w = x.shape
        y = torch.empty_like(x)
        kernels.instancenorm_relu_kernel(grid=n * c, block=256,
                                         args=(x, x, x, y, h * w, h * w, c, 0, self.eps))
        return y
