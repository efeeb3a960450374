"""relu(x @ W^T + b): weights made as nn.Linear makes them (kaiming_uniform_ and the private
``nn.init._calculate_fan_in_and_fan_out``, so a seeded ModelNew holds the reference's values), a 16x16 tiled
matmul with the bias and ReLU fused."""
import math

import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

linear_relu_src = r"""
#include <torch/extension.h>

#define TILE 16

__global__ void linear_relu_kernel(const float* __restrict__ x, const float* __restrict__ w,
                                   const float* __restrict__ b, float* __restrict__ y, int M, int N, int K) {
    __shared__ float xs[TILE][TILE];
    __shared__ float ws[TILE][TILE + 1];
    int row = blockIdx.y * TILE + threadIdx.y;   // sample
    int col = blockIdx.x * TILE + threadIdx.x;   // output feature
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
    if (row < M && col < N) y[(size_t)row * N + col] = fmaxf(acc + b[col], 0.f);
}

torch::Tensor linear_relu(torch::Tensor x, torch::Tensor w, torch::Tensor b) {
    TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "linear_relu: 2-D input and weight expected");
    auto xc = x.contiguous();
    auto wc = w.contiguous();
    const int M = xc.size(0), K = xc.size(1), N = wc.size(0);
    auto y = torch::empty({M, N}, xc.options());
    dim3 block(TILE, TILE);
    dim3 grid((N + TILE - 1) / TILE, (M + TILE - 1) / TILE);
    linear_relu_kernel<<<grid, block>>>(xc.data_ptr<float>(), wc.data_ptr<float>(), b.data_ptr<float>(),
                                        y.data_ptr<float>(), M, N, K);
    return y;
}
"""

linear_relu_cpp = "torch::Tensor linear_relu(torch::Tensor x, torch::Tensor w, torch::Tensor b);"

fused = load_inline(
    name="fused_linear_relu",
    cpp_sources=linear_relu_cpp,
    cuda_sources=linear_relu_src,
    functions=["linear_relu"],
    verbose=False,
)


class ModelNew(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        fan_in, _ = nn.init._calculate_fan_in_and_fan_out(self.weight)
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
        nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x):
        return fused.linear_relu(x, self.weight, self.bias)
