"""A (M, K) @ B (K, 1): one warp a row, strided loads and a ``__shfl_down_sync`` reduction, ``#pragma unroll``."""
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

matvec_source = r"""
#include <torch/extension.h>

__global__ void matvec_kernel(const float* __restrict__ A, const float* __restrict__ v, float* __restrict__ out,
                              int M, int K) {
    int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x & 31;
    if (warp >= M) return;
    const float* row = A + (size_t)warp * K;
    float acc = 0.f;
    for (int k = lane; k < K; k += 32) acc += row[k] * v[k];
    #pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_down_sync(0xffffffff, acc, offset);
    if (lane == 0) out[warp] = acc;
}

torch::Tensor matvec(torch::Tensor A, torch::Tensor B) {
    auto a = A.contiguous();
    auto b = B.contiguous();
    int M = a.size(0), K = a.size(1);
    auto out = torch::empty({M, 1}, a.options());
    const int threads = 256;
    const int blocks = (M * 32 + threads - 1) / threads;
    matvec_kernel<<<blocks, threads>>>(a.data_ptr<float>(), b.data_ptr<float>(), out.data_ptr<float>(), M, K);
    return out;
}
"""

matvec_ext = load_inline(
    name="warp_matvec",
    cpp_sources="torch::Tensor matvec(torch::Tensor A, torch::Tensor B);",
    cuda_sources=matvec_source,
    functions=["matvec"],
    extra_cuda_cflags=["-O3", "--ptxas-options=-v"],
)


class ModelNew(nn.Module):
    def __init__(self):
        super(ModelNew, self).__init__()

    def forward(self, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        return matvec_ext.matvec(A, B)
