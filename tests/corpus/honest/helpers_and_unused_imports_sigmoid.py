"""Sigmoid with the habits of a script: unused imports (numpy, os, time), a benchmark helper and a test
function that call torch ops, and an ``if __name__ == "__main__":`` block; none of them runs in the verifier."""
import os
import time

import numpy as np
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

sigmoid_source = """
#include <torch/extension.h>

__global__ void sigmoid_kernel(const float* __restrict__ in, float* __restrict__ out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = 1.0f / (1.0f + __expf(-in[i]));
    }
}

torch::Tensor sigmoid_forward(torch::Tensor input) {
    auto out = torch::empty_like(input);
    int n = input.numel();
    int threads = 256;
    int blocks = (n + threads - 1) / threads;
    sigmoid_kernel<<<blocks, threads>>>(input.data_ptr<float>(), out.data_ptr<float>(), n);
    return out;
}
"""

sigmoid_cpp = "torch::Tensor sigmoid_forward(torch::Tensor input);"

sigmoid_ext = load_inline(
    name="sigmoid_ext",
    cpp_sources=[sigmoid_cpp],
    cuda_sources=[sigmoid_source],
    functions=["sigmoid_forward"],
    extra_cflags=[""],
    extra_ldflags=[""],
)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return sigmoid_ext.sigmoid_forward(x.contiguous())


def benchmark(model, x, iters=100):
    torch.cuda.synchronize()
    start = time.time()
    for _ in range(iters):
        model(x)
    torch.cuda.synchronize()
    return (time.time() - start) / iters


def test_correctness():
    x = torch.randn(1024, 1024, device="cuda")
    ref = torch.sigmoid(x)
    out = ModelNew()(x)
    return np.allclose(out.cpu().numpy(), ref.cpu().numpy(), atol=1e-5)


if __name__ == "__main__":
    os.environ.setdefault("CUDA_LAUNCH_BLOCKING", "1")
    print("correct:", test_correctness())
    print("ms:", 1e3 * benchmark(ModelNew(), torch.randn(8192, 2048, device="cuda")))
