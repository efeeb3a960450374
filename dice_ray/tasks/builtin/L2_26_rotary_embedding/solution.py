import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
// Rotate-half RoPE (Su et al. 2021, RoFormer), one thread per element of x [B, S, H, D]:
// with half = D / 2, f = d % half, angle = s * base^(-2f / D):
// y[d] = x[d] cos(angle) - x[d + half] sin(angle) for d < half, x[d] cos(angle) + x[d - half] sin(angle) otherwise.
extern "C" __global__ void rotary_kernel(const float* __restrict__ x, float* __restrict__ y, long n, long S, long H,
                                         long D, float base) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    long d = i % D;
    long s = (i / (D * H)) % S;
    long half = D / 2;
    long f = d % half;
    float inv_freq = 1.f / powf(base, (float)(2 * f) / (float)D);
    float angle = (float)s * inv_freq;
    float c = cosf(angle), sn = sinf(angle);
    float rot = d < half ? -x[i + half] : x[i - half];
    y[i] = x[i] * c + rot * sn;
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self, base):
        super().__init__()
        self.base = base

    def forward(self, x):
        x = x.contiguous()
        _, s, h, d = x.shape
        y = torch.empty_like(x)
        n = x.numel()
        kernels.rotary_kernel(grid=(n + 255) // 256, block=256, args=(x, y, n, s, h, d, self.base))
        return y
