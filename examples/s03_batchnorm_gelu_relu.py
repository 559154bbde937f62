"""S03: Linear, BatchNorm1d (training mode: batch statistics), GELU (exact), ReLU."""

import torch
import torch.nn as nn
import torch.nn.functional as F

SIZES = {
    "full": dict(batch=16384, in_features=4096, out_features=4096),
    "small": dict(batch=8, in_features=64, out_features=128),
    "tiny": dict(batch=8, in_features=64, out_features=64),
}


class Model(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.batch_norm = nn.BatchNorm1d(out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gemm(x)
        x = self.batch_norm(x)
        x = F.gelu(x)
        x = torch.relu(x)
        return x


def get_init_inputs(size: str = "full") -> list:
    s = SIZES[size]
    return [s["in_features"], s["out_features"]]


def get_inputs(size: str = "full") -> list:
    s = SIZES[size]
    return [torch.rand(s["batch"], s["in_features"])]
