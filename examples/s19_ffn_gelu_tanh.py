"""S19: FFN on 3-D input: Linear(4096 -> 16384), GELU(approximate="tanh"), Linear(16384 -> 4096)."""

import torch
import torch.nn as nn

SIZES = {
    "full": dict(batch=8, seq_len=512, d_model=4096, d_hidden=16384),
    "small": dict(batch=2, seq_len=4, d_model=64, d_hidden=256),
    "tiny": dict(batch=1, seq_len=8, d_model=64, d_hidden=64),
}


class Model(nn.Module):
    def __init__(self, d_model: int, d_hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_hidden)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(d_hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc1(x)
        x = self.act(x)
        x = self.fc2(x)
        return x


def get_init_inputs(size: str = "full") -> list:
    s = SIZES[size]
    return [s["d_model"], s["d_hidden"]]


def get_inputs(size: str = "full") -> list:
    s = SIZES[size]
    return [torch.rand(s["batch"], s["seq_len"], s["d_model"])]
