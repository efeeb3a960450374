"""Softsign on a float64 task: forward casts its input with ``x.double()``, a no-op on the task's float64 input
(``x.to(torch.float64)`` under another name), before a double-precision grid-stride kernel."""
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

softsign_src = r"""
#include <torch/extension.h>

__global__ void softsign_f64_kernel(const double* __restrict__ x, double* __restrict__ y, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        double v = x[i];
        y[i] = v / (1.0 + fabs(v));
    }
}

torch::Tensor softsign_f64(torch::Tensor x) {
    TORCH_CHECK(x.scalar_type() == torch::kFloat64, "softsign_f64: float64 expected");
    auto y = torch::empty_like(x);
    long n = x.numel();
    int blocks = (int)std::min<long>((n + 255) / 256, 65535);
    softsign_f64_kernel<<<blocks, 256>>>(x.data_ptr<double>(), y.data_ptr<double>(), n);
    return y;
}
"""

softsign_ext = load_inline(
    name="softsign_float64_double_cast",
    cpp_sources="torch::Tensor softsign_f64(torch::Tensor x);",
    cuda_sources=softsign_src,
    functions=["softsign_f64"],
    verbose=False,
)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.double().contiguous()
        return softsign_ext.softsign_f64(x)
