"""S21: Linear(4096 -> 4096) on a 3-D input, RMSNorm(4096), SiLU."""

import torch
import torch.nn as nn

SIZES = {
    "full": dict(batch=8, seq_len=512, in_features=4096, out_features=4096),
    "small": dict(batch=2, seq_len=4, in_features=64, out_features=64),
    "tiny": dict(batch=1, seq_len=8, in_features=64, out_features=64),
}


class Model(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.norm = nn.RMSNorm(out_features)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        x = self.norm(x)
        x = self.act(x)
        return x


def get_init_inputs(size: str = "full") -> list:
    s = SIZES[size]
    return [s["in_features"], s["out_features"]]


def get_inputs(size: str = "full") -> list:
    s = SIZES[size]
    return [torch.rand(s["batch"], s["seq_len"], s["in_features"])]
