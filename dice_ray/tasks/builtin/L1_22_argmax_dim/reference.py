import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.argmax(x, dim=self.dim)


d0 = 16
d1 = 512
d2 = 1024


def get_inputs():
    return [torch.randn(d0, d1, d2)]


def get_init_inputs():
    return [1]
