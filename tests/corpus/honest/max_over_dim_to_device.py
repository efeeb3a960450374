"""max over dim 1 of a 3-D tensor: one thread an output element, the input moved with ``.to(device)``
and ``.to(torch.float32)`` (no-ops on the GPU) and the device read with ``torch.cuda.current_device()``."""
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

max_dim_source = """
#include <torch/extension.h>
#include <cfloat>

__global__ void max_dim1_kernel(const float* __restrict__ x, float* __restrict__ out, int d0, int d1, int d2) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= d0 * d2) return;
    int i = idx / d2, k = idx % d2;
    const float* base = x + (size_t)i * d1 * d2 + k;
    float m = -FLT_MAX;
    for (int j = 0; j < d1; ++j) m = fmaxf(m, base[(size_t)j * d2]);
    out[idx] = m;
}

torch::Tensor max_dim1(torch::Tensor x) {
    TORCH_CHECK(x.dim() == 3, "max_dim1 expects a 3-D tensor");
    auto xc = x.contiguous();
    int d0 = xc.size(0), d1 = xc.size(1), d2 = xc.size(2);
    auto out = torch::empty({d0, d2}, xc.options());
    int total = d0 * d2;
    max_dim1_kernel<<<(total + 255) / 256, 256>>>(xc.data_ptr<float>(), out.data_ptr<float>(), d0, d1, d2);
    return out;
}
"""

max_dim = load_inline(
    name="max_dim1",
    cpp_sources=["torch::Tensor max_dim1(torch::Tensor x);"],
    cuda_sources=[max_dim_source],
    functions=["max_dim1"],
    verbose=False,
)


class ModelNew(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        device = torch.device("cuda", torch.cuda.current_device())
        x = x.to(device).to(torch.float32)
        assert self.dim == 1, "this kernel reduces over dim 1"
        return max_dim.max_dim1(x)
