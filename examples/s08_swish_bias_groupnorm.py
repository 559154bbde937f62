"""S08: Linear (K = 1024), sigmoid(x) * x, + vector (N,), GroupNorm(64)."""

import torch
import torch.nn as nn

# 64 channels per group at every size.
SIZES = {
    "full": dict(batch=32768, in_features=1024, out_features=4096, num_groups=64),
    "small": dict(batch=8, in_features=64, out_features=128, num_groups=2),
    "tiny": dict(batch=8, in_features=64, out_features=64, num_groups=1),
}


class Model(nn.Module):
    def __init__(self, in_features: int, out_features: int, num_groups: int):
        super().__init__()
        self.matmul = nn.Linear(in_features, out_features)
        self.bias = nn.Parameter(torch.randn(out_features))
        self.group_norm = nn.GroupNorm(num_groups, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.matmul(x)
        x = torch.sigmoid(x) * x
        x = x + self.bias
        x = self.group_norm(x)
        return x


def get_init_inputs(size: str = "full") -> list:
    s = SIZES[size]
    return [s["in_features"], s["out_features"], s["num_groups"]]


def get_inputs(size: str = "full") -> list:
    s = SIZES[size]
    return [torch.rand(s["batch"], s["in_features"])]
