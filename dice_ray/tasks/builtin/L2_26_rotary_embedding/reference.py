import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, base: float):
        super().__init__()
        self.base = base

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [batch, seq, heads, head_dim]; rotate-half RoPE (Su et al. 2021, RoFormer) as in GPT-NeoX / Llama
        _, s, _, d = x.shape
        inv_freq = 1.0 / (self.base ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
        freqs = torch.outer(torch.arange(s, device=x.device, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos = emb.cos()[None, :, None, :]
        sin = emb.sin()[None, :, None, :]
        rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
        return x * cos + rotated * sin


batch_size = 8
seq_len = 1024
heads = 16
head_dim = 64
base = 10000.0


def get_inputs():
    return [torch.randn(batch_size, seq_len, heads, head_dim)]


def get_init_inputs():
    return [base]
