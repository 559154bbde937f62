"""S27: a pre-norm residual: h = x + Linear(a), returning h and RMSNorm(h) (the next block's
residual and its normalised input: a chain value read outside the chain)."""

import torch
import torch.nn as nn

SIZES = {
    "full": dict(batch=8, seq_len=1024, features=4096),
    "small": dict(batch=2, seq_len=4, features=64),
    "tiny": dict(batch=1, seq_len=8, features=64),
}


class Model(nn.Module):
    def __init__(self, features: int):
        super().__init__()
        self.linear = nn.Linear(features, features)
        self.norm = nn.RMSNorm(features)

    def forward(self, a: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x + self.linear(a)
        return h, self.norm(h)


def get_init_inputs(size: str = "full") -> list:
    return [SIZES[size]["features"]]


def get_inputs(size: str = "full") -> list:
    s = SIZES[size]
    shape = (s["batch"], s["seq_len"], s["features"])
    return [torch.rand(shape), torch.rand(shape)]
