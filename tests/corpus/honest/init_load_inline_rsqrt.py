"""rsqrt with its extension built in ``__init__``: ``self.rsqrt_ext = load_inline(...)``, the CUDA source a local
string of ``__init__``, the C++ declaration a module-level string; forward calls ``self.rsqrt_ext.rsqrt(x)``."""
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

RSQRT_DECL = "torch::Tensor rsqrt(torch::Tensor x);"


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        rsqrt_src = r"""
#include <torch/extension.h>

__global__ void rsqrt_kernel(const float* __restrict__ x, float* __restrict__ y, long n) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = rsqrtf(x[i]);
}

torch::Tensor rsqrt(torch::Tensor x) {
    auto xc = x.contiguous();
    auto y = torch::empty_like(xc);
    long n = xc.numel();
    rsqrt_kernel<<<(n + 255) / 256, 256>>>(xc.data_ptr<float>(), y.data_ptr<float>(), n);
    return y;
}
"""
        flags = ["-O3"]
        self.rsqrt_ext = load_inline(
            name="rsqrt_built_in_init",
            cpp_sources=RSQRT_DECL,
            cuda_sources=rsqrt_src,
            functions=["rsqrt"],
            extra_cuda_cflags=flags,
            verbose=False,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rsqrt_ext.rsqrt(x)
