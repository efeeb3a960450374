import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, threshold: float, value: float):
        super().__init__()
        self.threshold = threshold
        self.value = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.threshold(x, self.threshold, self.value)


batch_size = 8192
dim = 2048


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return [0.1, -1.0]
