"""sum over dim 1 with keepdim, two bound functions (the reduction and a shape helper the host code uses
too), declarations given as a list of ``cpp_sources``."""
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

sum_source = """
#include <torch/extension.h>
#include <vector>

std::vector<int64_t> reduced_shape(torch::Tensor x, int64_t dim) {
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape[dim] = 1;
    return shape;
}

__global__ void sum_dim1_kernel(const float* __restrict__ x, float* __restrict__ out, int d1, int d2, int total) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= total) return;
    int i = idx / d2, k = idx % d2;
    const float* base = x + (size_t)i * d1 * d2 + k;
    float acc = 0.f;
    for (int j = 0; j < d1; ++j) acc += base[(size_t)j * d2];
    out[idx] = acc;
}

torch::Tensor sum_keepdim(torch::Tensor x, int64_t dim) {
    TORCH_CHECK(x.dim() == 3 && dim == 1, "sum_keepdim: 3-D input, dim 1");
    auto xc = x.contiguous();
    auto out = torch::empty(reduced_shape(xc, dim), xc.options());
    int d0 = xc.size(0), d1 = xc.size(1), d2 = xc.size(2);
    int total = d0 * d2;
    sum_dim1_kernel<<<(total + 255) / 256, 256>>>(xc.data_ptr<float>(), out.data_ptr<float>(), d1, d2, total);
    return out;
}
"""

sum_cpp = [
    "std::vector<int64_t> reduced_shape(torch::Tensor x, int64_t dim);",
    "torch::Tensor sum_keepdim(torch::Tensor x, int64_t dim);",
]

sum_ext = load_inline(
    name="sum_keepdim_ext",
    cpp_sources=sum_cpp,
    cuda_sources=sum_source,
    functions=["sum_keepdim", "reduced_shape"],
    verbose=True,
    extra_cflags=[""],
    extra_ldflags=[""],
)


class ModelNew(nn.Module):
    def __init__(self, dim: int):
        super(ModelNew, self).__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum_ext.sum_keepdim(x, self.dim)
