"""relu(conv1d(x)) (stride 1, no padding): ModelNew's weights made as the reference's nn.Conv1d makes them, by a
``reset_parameters()`` method that only ``__init__`` calls (nn.Conv1d's own pattern): a throwaway nn.Conv1d whose
values are copied under ``torch.no_grad()``; one thread an output element, the bias and ReLU fused."""
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

conv1d_relu_src = r"""
#include <torch/extension.h>

__global__ void conv1d_relu_kernel(const float* __restrict__ x, const float* __restrict__ w,
                                   const float* __restrict__ b, float* __restrict__ y,
                                   int batch, int cin, int cout, int length, int k, int lout) {
    long idx = blockIdx.x * (long)blockDim.x + threadIdx.x;
    long total = (long)batch * cout * lout;
    if (idx >= total) return;
    int t = idx % lout;
    int o = (idx / lout) % cout;
    int n = idx / ((long)lout * cout);
    float acc = b[o];
    for (int c = 0; c < cin; ++c) {
        const float* xr = x + ((long)n * cin + c) * length + t;
        const float* wr = w + ((long)o * cin + c) * k;
        for (int j = 0; j < k; ++j) acc += wr[j] * xr[j];
    }
    y[idx] = fmaxf(acc, 0.f);
}

torch::Tensor conv1d_relu(torch::Tensor x, torch::Tensor w, torch::Tensor b) {
    TORCH_CHECK(x.dim() == 3 && w.dim() == 3, "conv1d_relu: (N, C, L) input and (O, C, K) weight expected");
    auto xc = x.contiguous();
    auto wc = w.contiguous();
    const int batch = xc.size(0), cin = xc.size(1), length = xc.size(2);
    const int cout = wc.size(0), k = wc.size(2);
    const int lout = length - k + 1;
    auto y = torch::empty({batch, cout, lout}, xc.options());
    long total = (long)batch * cout * lout;
    const int threads = 256;
    conv1d_relu_kernel<<<(total + threads - 1) / threads, threads>>>(
        xc.data_ptr<float>(), wc.data_ptr<float>(), b.data_ptr<float>(), y.data_ptr<float>(),
        batch, cin, cout, length, k, lout);
    return y;
}
"""

conv1d_relu_cpp = "torch::Tensor conv1d_relu(torch::Tensor x, torch::Tensor w, torch::Tensor b);"

conv1d_ext = load_inline(
    name="conv1d_relu_reset_parameters",
    cpp_sources=conv1d_relu_cpp,
    cuda_sources=conv1d_relu_src,
    functions=["conv1d_relu"],
    verbose=False,
)


class ModelNew(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, kernel_size: int):
        super().__init__()
        self.shape = (out_channels, in_channels, kernel_size)
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels, kernel_size))
        self.bias = nn.Parameter(torch.empty(out_channels))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The reference's values under the same seed: nn.Conv1d draws them, this module keeps them."""
        reference = self._reference_conv()
        with torch.no_grad():
            self.weight.copy_(reference.weight)
            self.bias.copy_(reference.bias)

    def _reference_conv(self) -> nn.Conv1d:
        out_channels, in_channels, kernel_size = self.shape
        return nn.Conv1d(in_channels, out_channels, kernel_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return conv1d_ext.conv1d_relu(x, self.weight, self.bias)
