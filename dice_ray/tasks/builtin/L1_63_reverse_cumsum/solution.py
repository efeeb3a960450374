import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
// Suffix sums y[j] = sum_{k >= j} x[k]: an inclusive scan of the row read from its end.
// One block of 256 threads per row; each thread scans a contiguous chunk, offset by the
// inclusive block scan (Hillis-Steele) of the chunk results.
extern "C" __global__ void reverse_cumsum_kernel(const float* __restrict__ x, float* __restrict__ y, long cols) {
    __shared__ float acc[256];
    const float* xr = x + blockIdx.x * cols;
    float* yr = y + blockIdx.x * cols;
    long per = (cols + blockDim.x - 1) / blockDim.x;
    long start = threadIdx.x * per;
    long end = min(start + per, cols);
    float s = 0.f;
    for (long j = start; j < end; ++j) s += xr[cols - 1 - j];
    acc[threadIdx.x] = s;
    __syncthreads();
    for (int off = 1; off < blockDim.x; off <<= 1) {
        float v = threadIdx.x >= off ? acc[threadIdx.x - off] : 0.f;
        __syncthreads();
        acc[threadIdx.x] += v;
        __syncthreads();
    }
    float run = threadIdx.x > 0 ? acc[threadIdx.x - 1] : 0.f;
    for (long j = start; j < end; ++j) {
        run += xr[cols - 1 - j];
        yr[cols - 1 - j] = run;
    }
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        x = x.contiguous()
        cols = x.shape[-1]
        rows = x.numel() // cols
        y = torch.empty_like(x)
        kernels.reverse_cumsum_kernel(grid=rows, block=256, args=(x, y, cols))
        return y
