import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
// torch.nn.functional.threshold: y = x if x > threshold else value.
extern "C" __global__ void threshold_kernel(const float* __restrict__ x, float* __restrict__ y, long n,
                                           float threshold, float value) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) {
        float v = x[i];
        y[i] = v > threshold ? v : value;
    }
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self, threshold, value):
        super().__init__()
        self.threshold = threshold
        self.value = value

    def forward(self, x):
        x = x.contiguous()
        y = torch.empty_like(x)
        n = x.numel()
        kernels.threshold_kernel(grid=(n + 255) // 256, block=256, args=(x, y, n, self.threshold, self.value))
        return y
