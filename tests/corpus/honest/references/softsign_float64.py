import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    """Softsign in double precision (a task whose inputs are float64)."""

    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softsign(x)


batch_size = 4096
dim = 2048


def get_inputs():
    return [torch.randn(batch_size, dim, dtype=torch.float64)]


def get_init_inputs():
    return []
