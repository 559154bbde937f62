"""S18: Linear, BatchNorm1d (training mode), + vector (1,), / 1.0, x * sigmoid(x)."""

import torch
import torch.nn as nn

SIZES = {
    "full": dict(batch=1024, in_features=8192, out_features=8192),
    "small": dict(batch=8, in_features=64, out_features=128),
    "tiny": dict(batch=8, in_features=64, out_features=64),
}


class Model(nn.Module):
    def __init__(self, in_features: int, out_features: int, divide_value: float = 1.0):
        super().__init__()
        self.matmul = nn.Linear(in_features, out_features)
        self.bn = nn.BatchNorm1d(out_features)
        self.bias = nn.Parameter(torch.randn(1))
        self.divide_value = divide_value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.matmul(x)
        x = self.bn(x)
        x = x + self.bias
        x = x / self.divide_value
        x = x * torch.sigmoid(x)
        return x


def get_init_inputs(size: str = "full") -> list:
    s = SIZES[size]
    return [s["in_features"], s["out_features"]]


def get_inputs(size: str = "full") -> list:
    s = SIZES[size]
    return [torch.rand(s["batch"], s["in_features"])]
