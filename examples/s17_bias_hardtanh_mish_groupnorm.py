"""S17: Linear, + vector (N,), Hardtanh, Mish, GroupNorm(256) (activations before the norm)."""

import torch
import torch.nn as nn

# 32 channels per group at every size.
SIZES = {
    "full": dict(batch=1024, in_features=8192, out_features=8192, num_groups=256),
    "small": dict(batch=8, in_features=64, out_features=128, num_groups=4),
    "tiny": dict(batch=8, in_features=64, out_features=64, num_groups=2),
}


class Model(nn.Module):
    def __init__(self, in_features: int, out_features: int, num_groups: int):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.bias = nn.Parameter(torch.randn(out_features))
        self.hardtanh = nn.Hardtanh()
        self.mish = nn.Mish()
        self.groupnorm = nn.GroupNorm(num_groups=num_groups, num_channels=out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gemm(x)
        x = x + self.bias
        x = self.hardtanh(x)
        x = self.mish(x)
        x = self.groupnorm(x)
        return x


def get_init_inputs(size: str = "full") -> list:
    s = SIZES[size]
    return [s["in_features"], s["out_features"], s["num_groups"]]


def get_inputs(size: str = "full") -> list:
    s = SIZES[size]
    return [torch.rand(s["batch"], s["in_features"])]
