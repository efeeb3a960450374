import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, diagonal: int):
        super().__init__()
        self.diagonal = diagonal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.triu(x, diagonal=self.diagonal)


batch_size = 16
n = 1024


def get_inputs():
    return [torch.randn(batch_size, n, n)]


def get_init_inputs():
    return [1]
