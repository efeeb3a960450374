import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
// One thread per output element of x [rows, L] -> y [rows, OL]; no padding. Max of the window (acc starts at -inf).
extern "C" __global__ void maxpool1d_kernel(const float* __restrict__ x, float* __restrict__ y, long rows, long L,
                                        long OL, long k, long stride) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i >= rows * OL) return;
    long o = i % OL, r = i / OL;
    const float* xp = x + r * L + o * stride;
    float acc = __int_as_float(0xff800000);
    for (long a = 0; a < k; ++a) acc = fmaxf(acc, xp[a]);
    y[i] = acc;
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
        n, c, length = x.shape
        ol = (length - self.kernel_size) // self.stride + 1
        y = torch.empty(n, c, ol, device=x.device, dtype=x.dtype)
        total = n * c * ol
        kernels.maxpool1d_kernel(grid=(total + 255) // 256, block=256,
                                 args=(x, y, n * c, length, ol, self.kernel_size, self.stride))
        return y
