"""S24: BERT's output block (transformers' BertOutput): LayerNorm(dropout(dense(h)) + x).

In training the dropout draws a mask inside the fused op (a dropout stage); in eval it is the
identity. The suite runs it in eval mode (its outputs compare with eager's); tests/test_dropout.py
covers training."""

import torch
import torch.nn as nn

SIZES = {
    "full": dict(batch=8, seq_len=1024, hidden=4096, intermediate=16384),
    "small": dict(batch=2, seq_len=4, hidden=64, intermediate=128),
    "tiny": dict(batch=1, seq_len=8, hidden=64, intermediate=64),
}


class Model(nn.Module):
    def __init__(self, hidden: int, intermediate: int, p: float = 0.1):
        super().__init__()
        self.dense = nn.Linear(intermediate, hidden)
        self.dropout = nn.Dropout(p)
        self.LayerNorm = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(h)) + x)


def get_init_inputs(size: str = "full") -> list:
    s = SIZES[size]
    return [s["hidden"], s["intermediate"]]


def get_inputs(size: str = "full") -> list:
    s = SIZES[size]
    return [torch.rand(s["batch"], s["seq_len"], s["intermediate"]), torch.rand(s["batch"], s["seq_len"], s["hidden"])]
