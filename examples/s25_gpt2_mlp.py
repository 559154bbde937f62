"""S25: GPT-2's MLP and its residual, in transformers' own spelling: Conv1D (``addmm(b,
x.view(-1, K), W)`` with W stored (K, N), viewed back), gelu_new written out, Conv1D, dropout,
+ residual. The suite runs it in eval mode (dropout the identity); tests/test_dropout.py covers
training."""

import math

import torch
import torch.nn as nn

SIZES = {
    "full": dict(batch=8, seq_len=1024, hidden=4096, ffn=16384),
    "small": dict(batch=2, seq_len=4, hidden=64, ffn=128),
    "tiny": dict(batch=1, seq_len=8, hidden=64, ffn=64),
}


class Conv1D(nn.Module):
    """transformers.pytorch_utils.Conv1D: a linear layer whose weight is stored (in, out)."""

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class Model(nn.Module):
    def __init__(self, hidden: int, ffn: int, p: float = 0.1):
        super().__init__()
        self.c_fc = Conv1D(ffn, hidden)
        self.c_proj = Conv1D(hidden, ffn)
        self.dropout = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(self.c_proj(gelu_new(self.c_fc(x))))


def get_init_inputs(size: str = "full") -> list:
    s = SIZES[size]
    return [s["hidden"], s["ffn"]]


def get_inputs(size: str = "full") -> list:
    s = SIZES[size]
    return [torch.rand(s["batch"], s["seq_len"], s["hidden"])]
