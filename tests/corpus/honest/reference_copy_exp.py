"""exp(x), with the task's ``Model`` and input functions copied into the file for a local check: the copy
is never used by ``ModelNew`` (nor run by the verifier)."""
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x)


exp_source = """
#include <torch/extension.h>

__global__ void exp_kernel(const float* in, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = expf(in[i]);
}

torch::Tensor exp_cuda(torch::Tensor in) {
    auto out = torch::empty_like(in);
    int n = in.numel();
    exp_kernel<<<(n + 255) / 256, 256>>>(in.data_ptr<float>(), out.data_ptr<float>(), n);
    return out;
}
"""

exp_ext = load_inline(
    name="exp_ext",
    cpp_sources="torch::Tensor exp_cuda(torch::Tensor in);",
    cuda_sources=exp_source,
    functions=["exp_cuda"],
    verbose=True,
    extra_cflags=[""],
    extra_ldflags=[""],
)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return exp_ext.exp_cuda(x.contiguous())


batch_size = 8192
dim = 2048


def get_inputs():
    return [torch.randn(batch_size, dim, device="cuda")]


def get_init_inputs():
    return []


def check():
    x = get_inputs()[0]
    torch.testing.assert_close(ModelNew()(x), Model()(x), rtol=1e-4, atol=1e-5)
