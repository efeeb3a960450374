import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
// One block of 256 threads per row; ties go to the smaller index, as in torch.
extern "C" __global__ void argmin_kernel(const float* __restrict__ x, long* __restrict__ y, long cols) {
    __shared__ float sv[256];
    __shared__ long si[256];
    const float* xr = x + blockIdx.x * cols;
    float best = __int_as_float(0x7f800000);  // +inf
    long bi = cols;
    for (long j = threadIdx.x; j < cols; j += blockDim.x) {
        float v = xr[j];
        if (v < best) { best = v; bi = j; }
    }
    sv[threadIdx.x] = best;
    si[threadIdx.x] = bi;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            float v = sv[threadIdx.x + s];
            long i = si[threadIdx.x + s];
            if (v < sv[threadIdx.x] || (v == sv[threadIdx.x] && i < si[threadIdx.x])) {
                sv[threadIdx.x] = v;
                si[threadIdx.x] = i;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) y[blockIdx.x] = si[0] < cols ? si[0] : 0;
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
        y = torch.empty(x.shape[:-1], device=x.device, dtype=torch.int64)
        kernels.argmin_kernel(grid=rows, block=256, args=(x, y, cols))
        return y
