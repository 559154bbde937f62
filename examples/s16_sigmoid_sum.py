"""S16: Linear, sigmoid, sum(dim=1, keepdim=True) (wide N, small M)."""

import torch
import torch.nn as nn

SIZES = {
    "full": dict(batch=128, in_features=32768, out_features=32768),
    "small": dict(batch=4, in_features=64, out_features=256),
    "tiny": dict(batch=8, in_features=64, out_features=64),
}


class Model(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        x = torch.sigmoid(x)
        x = torch.sum(x, dim=1, keepdim=True)
        return x


def get_init_inputs(size: str = "full") -> list:
    s = SIZES[size]
    return [s["in_features"], s["out_features"]]


def get_inputs(size: str = "full") -> list:
    s = SIZES[size]
    return [torch.rand(s["batch"], s["in_features"])]
