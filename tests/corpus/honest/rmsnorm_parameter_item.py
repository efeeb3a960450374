"""RMSNorm with its own ``nn.Parameter`` weight (ones, as the reference's), eps read from a one-element
buffer with ``.item()`` in forward, one block a row."""
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

rmsnorm_src = r"""
#include <torch/extension.h>

__global__ void rmsnorm_kernel(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
                               int cols, float eps) {
    __shared__ float red[256];
    const float* xr = x + (size_t)blockIdx.x * cols;
    float* yr = y + (size_t)blockIdx.x * cols;
    float acc = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) acc += xr[c] * xr[c];
    red[threadIdx.x] = acc;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
        __syncthreads();
    }
    float rms = sqrtf(red[0] / cols + eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) yr[c] = xr[c] / rms * w[c];
}

torch::Tensor rmsnorm(torch::Tensor x, torch::Tensor w, double eps) {
    auto xc = x.contiguous();
    int cols = xc.size(-1);
    int rows = xc.numel() / cols;
    auto y = torch::empty_like(xc);
    rmsnorm_kernel<<<rows, 256>>>(xc.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), cols, (float)eps);
    return y;
}
"""

rmsnorm_ext = load_inline(
    name="rmsnorm_ext",
    cpp_sources="torch::Tensor rmsnorm(torch::Tensor x, torch::Tensor w, double eps);",
    cuda_sources=rmsnorm_src,
    functions=["rmsnorm"],
    extra_cflags=["-O3", ""],
    extra_ldflags=[""],
)


class ModelNew(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.register_buffer("eps", torch.tensor([eps]))

    def forward(self, x):
        return rmsnorm_ext.rmsnorm(x, self.weight, self.eps.item())
