"""Softplus (threshold 20, as F.softplus) with the module constants written as KernelBench references write theirs,
tuple-unpacked on one line (``batch_size, dim = 8192, 2048``), and the kernel's launch constants the same way,
formatted into its source (``BLOCK, ITEMS = 256, 4``; ``LOW, HIGH = -20.0, 20.0``; ``GRID_CAP = 64 * 1024``)."""
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

batch_size, dim = 8192, 2048
BLOCK, ITEMS = 256, 4
LOW, HIGH = -20.0, 20.0
GRID_CAP = 64 * 1024

softplus_src = f"""
#include <torch/extension.h>

#define BLOCK {BLOCK}
#define ITEMS {ITEMS}

__global__ void __launch_bounds__(BLOCK) softplus_kernel(const float* __restrict__ x, float* __restrict__ y, long n) {{
    long base = (blockIdx.x * (long)BLOCK) * ITEMS + threadIdx.x;
    for (long start = base; start < n; start += (long)gridDim.x * BLOCK * ITEMS) {{
        #pragma unroll
        for (int k = 0; k < ITEMS; ++k) {{
            long i = start + (long)k * BLOCK;
            if (i < n) {{
                float v = x[i];
                y[i] = v > {HIGH}f ? v : (v < {LOW}f ? expf(v) : log1pf(expf(v)));
            }}
        }}
    }}
}}

torch::Tensor softplus(torch::Tensor x) {{
    auto xc = x.contiguous();
    auto y = torch::empty_like(xc);
    long n = xc.numel();
    long blocks = (n + (long)BLOCK * ITEMS - 1) / ((long)BLOCK * ITEMS);
    if (blocks > {GRID_CAP}) blocks = {GRID_CAP};
    softplus_kernel<<<(int)blocks, BLOCK>>>(xc.data_ptr<float>(), y.data_ptr<float>(), n);
    return y;
}}
"""

softplus_ext = load_inline(
    name="softplus_tuple_constants",
    cpp_sources="torch::Tensor softplus(torch::Tensor x);",
    cuda_sources=softplus_src,
    functions=["softplus"],
    verbose=False,
)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return softplus_ext.softplus(x)


def get_inputs():
    return [torch.randn(batch_size, dim)]
