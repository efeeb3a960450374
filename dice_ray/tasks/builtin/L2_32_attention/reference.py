import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q, k, v [batch * heads, seq, head_dim]: softmax(q k^T * scale) v, no mask
        return torch.softmax(torch.bmm(q, k.transpose(1, 2)) * self.scale, dim=-1) @ v


batch_heads = 32
seq_len = 512
head_dim = 64
scale = 0.125


def get_inputs():
    return [torch.randn(batch_heads, seq_len, head_dim) for _ in range(3)]


def get_init_inputs():
    return [scale]
