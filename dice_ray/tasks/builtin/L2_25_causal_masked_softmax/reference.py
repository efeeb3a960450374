import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        s = scores.shape[-1]
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=scores.device), diagonal=1)
        return torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)


batch_size = 16
seq_len = 1024


def get_inputs():
    return [torch.randn(batch_size, seq_len, seq_len)]


def get_init_inputs():
    return []
