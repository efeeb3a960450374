"""Exact (erf) GELU, as F.gelu: forward casts its input with ``x.float()``, a no-op on the task's float32 input
(``x.to(torch.float32)`` under another name), before a grid-stride kernel."""
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

gelu_src = r"""
#include <torch/extension.h>

__global__ void gelu_erf_kernel(const float* __restrict__ x, float* __restrict__ y, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        float v = x[i];
        y[i] = 0.5f * v * (1.f + erff(v * 0.70710678118654752f));
    }
}

torch::Tensor gelu_erf(torch::Tensor x) {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32, "gelu_erf: float32 expected");
    auto y = torch::empty_like(x);
    long n = x.numel();
    int blocks = (int)std::min<long>((n + 255) / 256, 65535);
    gelu_erf_kernel<<<blocks, 256>>>(x.data_ptr<float>(), y.data_ptr<float>(), n);
    return y;
}
"""

gelu_ext = load_inline(
    name="gelu_erf_float_cast",
    cpp_sources="torch::Tensor gelu_erf(torch::Tensor x);",
    cuda_sources=gelu_src,
    functions=["gelu_erf"],
    verbose=False,
)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float().contiguous()
        return gelu_ext.gelu_erf(x)
