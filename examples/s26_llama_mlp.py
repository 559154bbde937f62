"""S26: Llama's MLP plus its residual: down(silu(gate(x)) * up(x)) + x, no biases (LlamaMLP)."""

import torch
import torch.nn as nn

SIZES = {
    "full": dict(batch=8, seq_len=1024, hidden=4096, ffn=11008),
    "small": dict(batch=2, seq_len=4, hidden=64, ffn=128),
    "tiny": dict(batch=1, seq_len=8, hidden=64, ffn=64),
}


class Model(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)) + x


def get_init_inputs(size: str = "full") -> list:
    s = SIZES[size]
    return [s["hidden"], s["ffn"]]


def get_inputs(size: str = "full") -> list:
    s = SIZES[size]
    return [torch.rand(s["batch"], s["seq_len"], s["hidden"])]
