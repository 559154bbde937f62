"""S02: Linear, GroupNorm(512), LeakyReLU(0.01), x + x."""

import torch
import torch.nn as nn

# 16 channels per group at every size.
SIZES = {
    "full": dict(batch=1024, in_features=8192, out_features=8192, num_groups=512),
    "small": dict(batch=8, in_features=64, out_features=128, num_groups=8),
    "tiny": dict(batch=8, in_features=64, out_features=64, num_groups=4),
    "decode16": dict(batch=16, in_features=8192, out_features=8192, num_groups=512),
    "decode1": dict(batch=1, in_features=8192, out_features=8192, num_groups=512),
}


class Model(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        num_groups: int,
        eps: float = 1e-5,
        negative_slope: float = 0.01,
    ):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)
        self.gn = nn.GroupNorm(num_groups=num_groups, num_channels=out_features, eps=eps)
        self.leaky_relu = nn.LeakyReLU(negative_slope=negative_slope)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc(x)
        x = self.gn(x)
        x = self.leaky_relu(x)
        x = x + x
        return x


def get_init_inputs(size: str = "full") -> list:
    s = SIZES[size]
    return [s["in_features"], s["out_features"], s["num_groups"]]


def get_inputs(size: str = "full") -> list:
    s = SIZES[size]
    return [torch.rand(s["batch"], s["in_features"])]
