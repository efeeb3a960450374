import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
// One thread per output element of x [planes, H, W] -> y [planes, OH, OW]; no padding, so every
// window is full and the divisor is k * k.
extern "C" __global__ void avgpool2d_kernel(const float* __restrict__ x, float* __restrict__ y, long planes,
                                           long H, long W, long OH, long OW, long k, long stride) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i >= planes * OH * OW) return;
    long ow = i % OW, oh = (i / OW) % OH, p = i / (OW * OH);
    const float* xp = x + p * H * W + (oh * stride) * W + ow * stride;
    float s = 0.f;
    for (long a = 0; a < k; ++a)
        for (long b = 0; b < k; ++b) s += xp[a * W + b];
    y[i] = s / (float)(k * k);
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self, kernel_size, stride):
        super().__init__()
        self.kernel_size = kernel_size
        self.stride = stride

    def forward(self, x):
        x = x.contiguous()
        n, c, h, w = x.shape
        oh = (h - self.kernel_size) // self.stride + 1
        ow = (w - self.kernel_size) // self.stride + 1
        y = torch.empty(n, c, oh, ow, device=x.device, dtype=x.dtype)
        total = n * c * oh * ow
        kernels.avgpool2d_kernel(grid=(total + 255) // 256, block=256,
                                 args=(x, y, n * c, h, w, oh, ow, self.kernel_size, self.stride))
        return y
