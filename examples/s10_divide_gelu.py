"""S10: Linear, x / 10.0, GELU."""

import torch
import torch.nn as nn
import torch.nn.functional as F

SIZES = {
    "full": dict(batch=1024, in_features=8192, out_features=8192),
    "small": dict(batch=8, in_features=64, out_features=128),
    "tiny": dict(batch=8, in_features=64, out_features=64),
    "decode16": dict(batch=16, in_features=8192, out_features=8192),
    "decode1": dict(batch=1, in_features=8192, out_features=8192),
}


class Model(nn.Module):
    def __init__(self, in_features: int, out_features: int, divisor: float = 10.0):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.divisor = divisor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        x = x / self.divisor
        x = F.gelu(x)
        return x


def get_init_inputs(size: str = "full") -> list:
    s = SIZES[size]
    return [s["in_features"], s["out_features"]]


def get_inputs(size: str = "full") -> list:
    s = SIZES[size]
    return [torch.rand(s["batch"], s["in_features"])]
