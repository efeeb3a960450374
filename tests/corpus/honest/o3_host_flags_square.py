"""x * x with ``-O3`` in ``extra_cflags`` and ``extra_cuda_cflags`` (on the allowed list; g++ 12 once crashed
on it with the verifier's precompiled header), a ``get_inputs`` copy and a main block that never run."""
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

square_source = r"""
#include <torch/extension.h>

__global__ void square_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) {
        float v = x[i];
        y[i] = v * v;
    }
}

torch::Tensor square_cuda(torch::Tensor x) {
    TORCH_CHECK(x.is_cuda(), "x must be a CUDA tensor");
    auto xc = x.contiguous();
    auto y = torch::empty_like(xc);
    int64_t n = xc.numel();
    const int threads = 256;
    const int blocks = (int)((n + threads - 1) / threads);
    square_kernel<<<blocks, threads>>>(xc.data_ptr<float>(), y.data_ptr<float>(), n);
    return y;
}
"""

square_cpp_source = "torch::Tensor square_cuda(torch::Tensor x);"

square = load_inline(
    name="square_o3",
    cpp_sources=square_cpp_source,
    cuda_sources=square_source,
    functions=["square_cuda"],
    verbose=False,
    extra_cflags=["-O3"],
    extra_cuda_cflags=["-O3"],
)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return square.square_cuda(x)


batch_size = 8192
dim = 2048


def get_inputs():
    return [torch.randn(batch_size, dim).cuda()]


def get_init_inputs():
    return []


if __name__ == "__main__":
    torch.manual_seed(0)
    x = get_inputs()[0]
    print(torch.allclose(ModelNew()(x), x * x))
