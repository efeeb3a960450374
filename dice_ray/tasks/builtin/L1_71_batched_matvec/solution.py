import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
// y[b, m, 0] = sum_k A[b, m, k] * v[b, k, 0]. One warp per output row (8 warps a 256-thread block),
// lanes stride over k, then a warp shuffle sum.
extern "C" __global__ void batched_matvec_kernel(const float* __restrict__ A, const float* __restrict__ v,
                                                 float* __restrict__ y, long rows, long M, long K) {
    long r = blockIdx.x * (long)(blockDim.x >> 5) + (threadIdx.x >> 5);  // row in [0, batch * M)
    int lane = threadIdx.x & 31;
    float s = 0.f;
    if (r < rows) {
        const float* ar = A + r * K;
        const float* vb = v + (r / M) * K;
        for (long k = lane; k < K; k += 32) s += ar[k] * vb[k];
    }
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
    if (r < rows && lane == 0) y[r] = s;
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a, v):
        a = a.contiguous()
        v = v.contiguous()
        b, M, K = a.shape
        y = torch.empty(b, M, 1, device=a.device, dtype=a.dtype)
        rows = b * M
        kernels.batched_matvec_kernel(grid=(rows + 7) // 8, block=256, args=(a, v, y, rows, M, K))
        return y
