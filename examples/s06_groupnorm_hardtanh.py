"""S06: Linear, GroupNorm(16), Hardtanh(-2, 2)."""

import torch
import torch.nn as nn

# 16 groups at every size (512 channels per group at full size, 8 at small, 4 at tiny).
SIZES = {
    "full": dict(batch=1024, in_features=8192, out_features=8192, num_groups=16),
    "small": dict(batch=8, in_features=64, out_features=128, num_groups=16),
    "tiny": dict(batch=8, in_features=64, out_features=64, num_groups=16),
}


class Model(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        num_groups: int,
        hardtanh_min: float = -2.0,
        hardtanh_max: float = 2.0,
    ):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.group_norm = nn.GroupNorm(num_groups, out_features)
        self.hardtanh = nn.Hardtanh(min_val=hardtanh_min, max_val=hardtanh_max)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gemm(x)
        x = self.group_norm(x)
        x = self.hardtanh(x)
        return x


def get_init_inputs(size: str = "full") -> list:
    s = SIZES[size]
    return [s["in_features"], s["out_features"], s["num_groups"]]


def get_inputs(size: str = "full") -> list:
    s = SIZES[size]
    return [torch.rand(s["batch"], s["in_features"])]
