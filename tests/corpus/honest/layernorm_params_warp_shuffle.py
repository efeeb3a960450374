"""LayerNorm over the last dim with the reference's own parameters (an ``nn.LayerNorm`` held for its weight
and bias only), one warp a row, mean and variance by ``__shfl_xor_sync``."""
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

layernorm_source = r"""
#include <torch/extension.h>

__inline__ __device__ float warp_sum(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}

__global__ void layernorm_kernel(const float* __restrict__ x, const float* __restrict__ gamma,
                                 const float* __restrict__ beta, float* __restrict__ y,
                                 int rows, int cols, float eps) {
    int warps_per_block = blockDim.x / 32;
    int row = blockIdx.x * warps_per_block + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= rows) return;
    const float* xr = x + (size_t)row * cols;
    float* yr = y + (size_t)row * cols;
    float s = 0.f;
    for (int c = lane; c < cols; c += 32) s += xr[c];
    float mean = warp_sum(s) / cols;
    float v = 0.f;
    for (int c = lane; c < cols; c += 32) { float d = xr[c] - mean; v += d * d; }
    float rstd = rsqrtf(warp_sum(v) / cols + eps);
    for (int c = lane; c < cols; c += 32) yr[c] = (xr[c] - mean) * rstd * gamma[c] + beta[c];
}

torch::Tensor layernorm_forward(torch::Tensor x, torch::Tensor gamma, torch::Tensor beta, double eps) {
    auto xc = x.contiguous();
    const int cols = xc.size(-1);
    const int rows = xc.numel() / cols;
    auto y = torch::empty_like(xc);
    const int threads = 256;
    const int rows_per_block = threads / 32;
    layernorm_kernel<<<(rows + rows_per_block - 1) / rows_per_block, threads>>>(
        xc.data_ptr<float>(), gamma.data_ptr<float>(), beta.data_ptr<float>(), y.data_ptr<float>(),
        rows, cols, (float)eps);
    return y;
}
"""

layernorm_cpp_source = "torch::Tensor layernorm_forward(torch::Tensor x, torch::Tensor gamma, torch::Tensor beta, double eps);"

layernorm = load_inline(
    name="layernorm_warp",
    cpp_sources=layernorm_cpp_source,
    cuda_sources=layernorm_source,
    functions=["layernorm_forward"],
    verbose=True,
    extra_cflags=["-O3"],
    extra_ldflags=[""],
)


class ModelNew(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.ln = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layernorm.layernorm_forward(x, self.ln.weight, self.ln.bias, self.ln.eps)
