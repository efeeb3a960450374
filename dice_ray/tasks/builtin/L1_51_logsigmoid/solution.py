import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
// log(sigmoid(x)) = min(x, 0) - log1p(exp(-|x|)), stable for large |x|.
extern "C" __global__ void logsigmoid_kernel(const float* __restrict__ x, float* __restrict__ y, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) {
        float v = x[i];
        y[i] = fminf(v, 0.f) - log1pf(expf(-fabsf(v)));
    }
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        x = x.contiguous()
        y = torch.empty_like(x)
        n = x.numel()
        kernels.logsigmoid_kernel(grid=(n + 255) // 256, block=256, args=(x, y, n))
        return y
