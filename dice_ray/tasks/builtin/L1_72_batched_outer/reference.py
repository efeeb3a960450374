import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a.unsqueeze(2) * b.unsqueeze(1)


batch_size = 128
M = 512
N = 512


def get_inputs():
    return [torch.randn(batch_size, M), torch.randn(batch_size, N)]


def get_init_inputs():
    return []
