import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, scale: float, min_val: float, max_val: float):
        super().__init__()
        self.scale = scale
        self.min_val = min_val
        self.max_val = max_val

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(torch.clamp(x * self.scale, self.min_val, self.max_val))


batch_size = 8192
dim = 2048


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return [2.0, -1.0, 1.0]
