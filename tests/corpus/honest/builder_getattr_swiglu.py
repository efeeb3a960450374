"""silu(x @ W1^T) * (x @ W2^T): the two projections built by a ``_projection()`` method only ``__init__`` calls
(an nn.Linear each, in the reference's order, so a seeded ModelNew holds its values; forward reads their weights,
never calls them), read back in forward by name, ``getattr(self, "proj_" + name)`` (the style of solutions that
read nn.LSTM's ``weight_ih_l{k}``); one tiled kernel computes both products and fuses the gate."""
from typing import Tuple

import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

swiglu_src = r"""
#include <torch/extension.h>

#define TILE 16

__global__ void swiglu_kernel(const float* __restrict__ x, const float* __restrict__ w1,
                              const float* __restrict__ w2, float* __restrict__ y, int M, int N, int K) {
    __shared__ float xs[TILE][TILE];
    __shared__ float as[TILE][TILE + 1];
    __shared__ float bs[TILE][TILE + 1];
    int row = blockIdx.y * TILE + threadIdx.y;
    int col = blockIdx.x * TILE + threadIdx.x;
    float gate = 0.f, up = 0.f;
    for (int k0 = 0; k0 < K; k0 += TILE) {
        int kx = k0 + threadIdx.x;
        int kw = k0 + threadIdx.y;
        int wrow = blockIdx.x * TILE + threadIdx.x;
        xs[threadIdx.y][threadIdx.x] = (row < M && kx < K) ? x[(size_t)row * K + kx] : 0.f;
        as[threadIdx.y][threadIdx.x] = (wrow < N && kw < K) ? w1[(size_t)wrow * K + kw] : 0.f;
        bs[threadIdx.y][threadIdx.x] = (wrow < N && kw < K) ? w2[(size_t)wrow * K + kw] : 0.f;
        __syncthreads();
        #pragma unroll
        for (int k = 0; k < TILE; ++k) {
            float xv = xs[threadIdx.y][k];
            gate += xv * as[k][threadIdx.x];
            up += xv * bs[k][threadIdx.x];
        }
        __syncthreads();
    }
    if (row < M && col < N) y[(size_t)row * N + col] = gate / (1.f + expf(-gate)) * up;
}

torch::Tensor swiglu(torch::Tensor x, torch::Tensor w1, torch::Tensor w2) {
    TORCH_CHECK(x.dim() == 2 && w1.sizes() == w2.sizes(), "swiglu: 2-D input and two equal weights expected");
    auto xc = x.contiguous();
    const int M = xc.size(0), K = xc.size(1), N = w1.size(0);
    auto y = torch::empty({M, N}, xc.options());
    dim3 block(TILE, TILE);
    dim3 grid((N + TILE - 1) / TILE, (M + TILE - 1) / TILE);
    swiglu_kernel<<<grid, block>>>(xc.data_ptr<float>(), w1.data_ptr<float>(), w2.data_ptr<float>(),
                                   y.data_ptr<float>(), M, N, K);
    return y;
}
"""

swiglu_cpp = "torch::Tensor swiglu(torch::Tensor x, torch::Tensor w1, torch::Tensor w2);"

swiglu_ext = load_inline(
    name="swiglu_getattr_weights",
    cpp_sources=swiglu_cpp,
    cuda_sources=swiglu_src,
    functions=["swiglu"],
    verbose=False,
)


class ModelNew(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.names: Tuple[str, str] = ("gate", "up")  # the reference's w1, w2, built in that order
        self.proj_gate = self._projection(dim, hidden)
        self.proj_up = self._projection(dim, hidden)

    def _projection(self, dim: int, hidden: int) -> nn.Linear:
        return nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w_gate, w_up = [getattr(self, "proj_" + name).weight.contiguous() for name in self.names]
        return swiglu_ext.swiglu(x, w_gate, w_up)
