"""tanh(x + bias) over (N, C, L) with a per-channel bias that may be absent (``bias=False``): forward hands the
kernel ``torch.Tensor()``, an empty placeholder, when there is none (a style of public solutions for optional
biases); the host code reads ``numel() == 0`` as no bias."""
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

bias_tanh_src = r"""
#include <torch/extension.h>

__global__ void bias_tanh_kernel(const float* __restrict__ x, const float* __restrict__ b, float* __restrict__ y,
                                 long n, int channels, int length, bool has_bias) {
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = x[i];
    if (has_bias) v += b[(i / length) % channels];
    y[i] = tanhf(v);
}

torch::Tensor bias_tanh(torch::Tensor x, torch::Tensor b) {
    TORCH_CHECK(x.dim() == 3, "bias_tanh: (N, C, L) input expected");
    auto xc = x.contiguous();
    const bool has_bias = b.numel() > 0;
    TORCH_CHECK(!has_bias || (b.is_cuda() && b.numel() == xc.size(1)), "bias_tanh: one bias a channel expected");
    auto y = torch::empty_like(xc);
    long n = xc.numel();
    bias_tanh_kernel<<<(n + 255) / 256, 256>>>(xc.data_ptr<float>(), has_bias ? b.data_ptr<float>() : nullptr,
                                               y.data_ptr<float>(), n, xc.size(1), xc.size(2), has_bias);
    return y;
}
"""

bias_tanh_ext = load_inline(
    name="bias_tanh_placeholder",
    cpp_sources="torch::Tensor bias_tanh(torch::Tensor x, torch::Tensor b);",
    cuda_sources=bias_tanh_src,
    functions=["bias_tanh"],
    verbose=False,
)


class ModelNew(nn.Module):
    def __init__(self, channels: int, bias: bool = True):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(channels, 1)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.bias.contiguous() if self.bias is not None else torch.Tensor()
        return bias_tanh_ext.bias_tanh(x, b)
