import torch
import torch.nn as nn
from dice_ray.launch import load_cuda

cuda_source = r"""
// y[m] = sum_k A[m, k] * x[k].
extern "C" __global__ void matvec_kernel(const float* __restrict__ A, const float* __restrict__ x,
                                        float* __restrict__ y, long M, long K) {
    long m = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (m >= M) return;
    const float* a = A + m * K;
    float s = 0.f;
    for (long k = 0; k < K; ++k) s += a[k] * x[k];
    y[m] = s;
}
"""

kernels = load_cuda(cuda_source)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, A, B):
        A = A.contiguous()
        B = B.contiguous()
        M, K = A.shape
        y = torch.empty(M, 1, device=A.device, dtype=A.dtype)
        kernels.matvec_kernel(grid=(M + 255) // 256, block=256, args=(A, B, y, M, K))
        return y
