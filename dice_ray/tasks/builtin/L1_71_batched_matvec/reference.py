import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.bmm(a, v)


batch_size = 32
M = 1024
K = 1024


def get_inputs():
    return [torch.randn(batch_size, M, K), torch.randn(batch_size, K, 1)]


def get_init_inputs():
    return []
