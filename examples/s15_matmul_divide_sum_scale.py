"""S15: torch.matmul(x, weight.T) (no nn.Linear), / 2, sum(dim=1, keepdim=True), * 1.5."""

import torch
import torch.nn as nn

SIZES = {
    "full": dict(batch=1024, in_features=8192, out_features=8192),
    "small": dict(batch=8, in_features=64, out_features=128),
    "tiny": dict(batch=8, in_features=64, out_features=64),
}


class Model(nn.Module):
    def __init__(self, in_features: int, out_features: int, scaling_factor: float = 1.5):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features))
        self.scaling_factor = scaling_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.matmul(x, self.weight.T)
        x = x / 2
        x = torch.sum(x, dim=1, keepdim=True)
        x = x * self.scaling_factor
        return x


def get_init_inputs(size: str = "full") -> list:
    s = SIZES[size]
    return [s["in_features"], s["out_features"]]


def get_inputs(size: str = "full") -> list:
    s = SIZES[size]
    return [torch.rand(s["batch"], s["in_features"])]
