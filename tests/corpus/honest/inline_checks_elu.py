"""ELU whose host code checks its input and reads a scalar option back with ``.cpu().item<double>()``
from a one-element tensor forward hands it (alpha), with ``--use_fast_math`` and
``extra_ldflags=["-lcudart"]`` (linked anyway)."""
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

elu_cuda = r"""
#include <torch/extension.h>

__global__ void elu_kernel(const float* __restrict__ x, float* __restrict__ y, float alpha, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) {
        float v = x[i];
        y[i] = v > 0.f ? v : alpha * (expf(v) - 1.f);
    }
}

torch::Tensor elu_forward(torch::Tensor x, torch::Tensor alpha) {
    TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
    TORCH_CHECK(alpha.numel() == 1, "alpha must hold one value");
    const float a = (float)alpha.cpu().item<double>();
    auto y = torch::empty_like(x);
    int64_t n = x.numel();
    elu_kernel<<<(n + 255) / 256, 256>>>(x.data_ptr<float>(), y.data_ptr<float>(), a, n);
    return y;
}
"""

elu = load_inline(
    name="elu_cpu_item",
    cpp_sources="torch::Tensor elu_forward(torch::Tensor x, torch::Tensor alpha);",
    cuda_sources=elu_cuda,
    functions=["elu_forward"],
    extra_cuda_cflags=["--use_fast_math"],
    extra_ldflags=["-lcudart"],
)


class ModelNew(nn.Module):
    def __init__(self, alpha: float = 1.0):
        super().__init__()
        self.register_buffer("alpha", torch.tensor(alpha, dtype=torch.float64))

    def forward(self, x):
        return elu.elu_forward(x.contiguous(), self.alpha)
