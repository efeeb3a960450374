"""SiLU with ``float4`` loads and stores, a scalar tail, ``__launch_bounds__`` and ptxas options passed as
``-Xptxas -O3`` (one string: torch's build splits it into two flags)."""
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

source = r"""
#include <torch/extension.h>

__device__ __forceinline__ float silu(float v) { return v / (1.0f + expf(-v)); }

__global__ void __launch_bounds__(256) silu_vec4_kernel(const float4* __restrict__ x, float4* __restrict__ y,
                                                        int64_t n4) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n4) {
        float4 v = x[i];
        v.x = silu(v.x); v.y = silu(v.y); v.z = silu(v.z); v.w = silu(v.w);
        y[i] = v;
    }
}

__global__ void silu_tail_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t start, int64_t n) {
    int64_t i = start + blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) y[i] = silu(x[i]);
}

torch::Tensor silu_forward(torch::Tensor x) {
    auto xc = x.contiguous();
    auto y = torch::empty_like(xc);
    int64_t n = xc.numel();
    int64_t n4 = n / 4;
    const int threads = 256;
    if (n4 > 0) {
        silu_vec4_kernel<<<(n4 + threads - 1) / threads, threads>>>(
            reinterpret_cast<const float4*>(xc.data_ptr<float>()), reinterpret_cast<float4*>(y.data_ptr<float>()), n4);
    }
    int64_t rest = n - 4 * n4;
    if (rest > 0) {
        silu_tail_kernel<<<1, threads>>>(xc.data_ptr<float>(), y.data_ptr<float>(), 4 * n4, n);
    }
    return y;
}
"""

silu_ext = load_inline(
    name="silu_vec4",
    cpp_sources="torch::Tensor silu_forward(torch::Tensor x);",
    cuda_sources=source,
    functions=["silu_forward"],
    extra_cuda_cflags=["-O3", "-Xptxas -O3", "-lineinfo"],
    extra_cflags=[],
    extra_ldflags=[],
)


class ModelNew(nn.Module):
    def forward(self, x):
        return silu_ext.silu_forward(x)
