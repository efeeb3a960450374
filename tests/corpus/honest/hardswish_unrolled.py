"""hardswish with a ``__device__`` helper, a ``#pragma unroll`` loop over 4 elements a thread, and the
extension built with ``extra_cuda_cflags=["-O3", "-Xcompiler", "-O3", "-maxrregcount=64"]``."""
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

hardswish_source = """
#include <torch/extension.h>

__device__ __forceinline__ float hardswish(float v) {
    return v * fminf(fmaxf(v + 3.0f, 0.0f), 6.0f) / 6.0f;
}

__global__ void hardswish_kernel(const float* __restrict__ x, float* __restrict__ y, int n) {
    int base = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
        int i = base + j;
        if (i < n) y[i] = hardswish(x[i]);
    }
}

torch::Tensor hardswish_cuda(torch::Tensor x) {
    auto xc = x.contiguous();
    auto y = torch::empty_like(xc);
    int n = xc.numel();
    int threads = 256;
    int blocks = (n + threads * 4 - 1) / (threads * 4);
    hardswish_kernel<<<blocks, threads>>>(xc.data_ptr<float>(), y.data_ptr<float>(), n);
    return y;
}
"""

hardswish_ext = load_inline(
    name="hardswish_unrolled",
    cpp_sources="torch::Tensor hardswish_cuda(torch::Tensor x);",
    cuda_sources=hardswish_source,
    functions=["hardswish_cuda"],
    extra_cuda_cflags=["-O3", "-Xcompiler", "-O3", "-maxrregcount=64"],
)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return hardswish_ext.hardswish_cuda(x)
