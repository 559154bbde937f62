"""S01: Linear, x * 2.0, LeakyReLU(0.1)."""

import torch
import torch.nn as nn

SIZES = {
    "full": dict(batch=1024, in_features=8192, out_features=8192),
    "small": dict(batch=8, in_features=64, out_features=128),
    "tiny": dict(batch=8, in_features=64, out_features=64),
    "decode16": dict(batch=16, in_features=8192, out_features=8192),
    "decode1": dict(batch=1, in_features=8192, out_features=8192),
}


class Model(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        multiplier: float = 2.0,
        negative_slope: float = 0.1,
    ):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.multiplier = multiplier
        self.leaky_relu = nn.LeakyReLU(negative_slope)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        x = x * self.multiplier
        return self.leaky_relu(x)


def get_init_inputs(size: str = "full") -> list:
    s = SIZES[size]
    return [s["in_features"], s["out_features"]]


def get_inputs(size: str = "full") -> list:
    s = SIZES[size]
    return [torch.rand(s["batch"], s["in_features"])]
