"""x * scale + bias with CHECK_* macros, ``AT_DISPATCH_FLOATING_TYPES``, a grid-stride template kernel
launched on the current stream, and the scalars passed from forward."""
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cuda_source = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

#define CHECK_CUDA(x) TORCH_CHECK(x.device().is_cuda(), #x " must be a CUDA tensor")
#define CHECK_CONTIGUOUS(x) TORCH_CHECK(x.is_contiguous(), #x " must be contiguous")
#define CHECK_INPUT(x) CHECK_CUDA(x); CHECK_CONTIGUOUS(x)

template <typename scalar_t>
__global__ void scale_bias_kernel(const scalar_t* __restrict__ x, scalar_t* __restrict__ y,
                                  scalar_t scale, scalar_t bias, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)blockDim.x * gridDim.x) {
        y[i] = x[i] * scale + bias;
    }
}

torch::Tensor scale_bias_cuda(torch::Tensor x, double scale, double bias) {
    CHECK_INPUT(x);
    auto y = torch::empty_like(x);
    const int64_t n = x.numel();
    const int threads = 256;
    const int blocks = std::min<int64_t>((n + threads - 1) / threads, 65535);
    cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "scale_bias_cuda", ([&] {
        scale_bias_kernel<scalar_t><<<blocks, threads, 0, stream>>>(
            x.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), (scalar_t)scale, (scalar_t)bias, n);
    }));
    return y;
}
"""

cpp_source = "torch::Tensor scale_bias_cuda(torch::Tensor x, double scale, double bias);"

scale_bias = load_inline(
    name="scale_bias_dispatch",
    cpp_sources=cpp_source,
    cuda_sources=cuda_source,
    functions=["scale_bias_cuda"],
    with_cuda=True,
    extra_cuda_cflags=["-O3", "--expt-relaxed-constexpr"],
)


class ModelNew(nn.Module):
    def __init__(self, scale: float, bias: float):
        super().__init__()
        self.scale = scale
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scale_bias.scale_bias_cuda(x.contiguous(), self.scale, self.bias)
