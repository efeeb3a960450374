"""gelu(x @ W^T + b) (erf GELU, as F.gelu): the weights initialised as nn.Linear initialises its own, by a chain of
methods only ``__init__`` reaches (``reset_parameters`` -> ``_init_weight``, ``_init_bias``; ``@torch.no_grad()``),
through ``import torch.nn.init as init``; a 16x16 tiled matmul with the bias and GELU fused."""
import math

import torch
import torch.nn as nn
import torch.nn.init as init
from torch.utils.cpp_extension import load_inline

linear_gelu_src = r"""
#include <torch/extension.h>

#define TILE 16

__global__ void linear_gelu_kernel(const float* __restrict__ x, const float* __restrict__ w,
                                   const float* __restrict__ b, float* __restrict__ y, int M, int N, int K) {
    __shared__ float xs[TILE][TILE];
    __shared__ float ws[TILE][TILE + 1];
    int row = blockIdx.y * TILE + threadIdx.y;
    int col = blockIdx.x * TILE + threadIdx.x;
    float acc = 0.f;
    for (int k0 = 0; k0 < K; k0 += TILE) {
        int kx = k0 + threadIdx.x;
        int kw = k0 + threadIdx.y;
        xs[threadIdx.y][threadIdx.x] = (row < M && kx < K) ? x[(size_t)row * K + kx] : 0.f;
        int wrow = blockIdx.x * TILE + threadIdx.x;
        ws[threadIdx.y][threadIdx.x] = (wrow < N && kw < K) ? w[(size_t)wrow * K + kw] : 0.f;
        __syncthreads();
        #pragma unroll
        for (int k = 0; k < TILE; ++k) acc += xs[threadIdx.y][k] * ws[k][threadIdx.x];
        __syncthreads();
    }
    if (row < M && col < N) {
        float v = acc + b[col];
        y[(size_t)row * N + col] = 0.5f * v * (1.f + erff(v * 0.70710678118654752f));
    }
}

torch::Tensor linear_gelu(torch::Tensor x, torch::Tensor w, torch::Tensor b) {
    TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "linear_gelu: 2-D input and weight expected");
    auto xc = x.contiguous();
    auto wc = w.contiguous();
    const int M = xc.size(0), K = xc.size(1), N = wc.size(0);
    auto y = torch::empty({M, N}, xc.options());
    dim3 block(TILE, TILE);
    dim3 grid((N + TILE - 1) / TILE, (M + TILE - 1) / TILE);
    linear_gelu_kernel<<<grid, block>>>(xc.data_ptr<float>(), wc.data_ptr<float>(), b.data_ptr<float>(),
                                        y.data_ptr<float>(), M, N, K);
    return y;
}
"""

linear_gelu_cpp = "torch::Tensor linear_gelu(torch::Tensor x, torch::Tensor w, torch::Tensor b);"

linear_gelu_ext = load_inline(
    name="linear_gelu_init_chain",
    cpp_sources=linear_gelu_cpp,
    cuda_sources=linear_gelu_src,
    functions=["linear_gelu"],
    verbose=False,
)


class ModelNew(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        fan_in = self._init_weight()
        self._init_bias(fan_in)

    def _init_weight(self) -> int:
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        fan_in, _ = init._calculate_fan_in_and_fan_out(self.weight)
        return fan_in

    def _init_bias(self, fan_in: int) -> None:
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
        init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_gelu_ext.linear_gelu(x, self.weight, self.bias)
