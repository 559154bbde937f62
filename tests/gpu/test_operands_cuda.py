"""Real-model spellings on CUDA: GPT-2's Conv1D (a weight stored (K, N)), views that regroup rows
and operands of the output's shape (a residual, a gate: read by the row kernels at each element's
own position) run in the fused kernels and equal eager, outputs and gradients; a chain that
would return a second value (keep()) ends at that value there."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: support, test_operands

from support import check_against_eager  # noqa: E402
from test_operands import B, K, N, T, BertOutput, Conv1DBlock, PreNormBlock, three_d  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class Conv1DMlp(nn.Module):
    """GPT-2's c_fc: x.view(-1, K), addmm with a (K, N) weight, .view(B, T, N), gelu_new."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(K, N) / K**0.5)
        self.bias = nn.Parameter(torch.randn(N))

    def forward(self, x):
        h = torch.addmm(self.bias, x.view(-1, K), self.weight).view(B, T, N)
        return 0.5 * h * (1.0 + torch.tanh(0.7978845608028654 * (h + 0.044715 * torch.pow(h, 3.0))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_a_conv1d_block_fuses_on_cuda(dtype, train):
    report = check_against_eager(Conv1DMlp, lambda: [torch.randn(B, T, K)], dtype=dtype, device="cuda",
                                 train=train, grads=train, draws=3)
    (row,) = report.rows
    assert row.status == "fused" and row.fused[:2] == ["addmm", f"view({B}, {T}, {N})"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("model", [BertOutput, Conv1DBlock], ids=["bert_output", "conv1d_residual"])
def test_a_chain_with_a_residual_fuses_on_cuda(model, train, dtype):
    report = check_against_eager(model, three_d, dtype=dtype, device="cuda", train=train, grads=train, draws=3)
    (row,) = report.rows
    assert row.status == "fused", report
    assert row.program.endswith("full") or " full" in row.program.split("||")[1]


def test_a_chain_that_would_return_a_second_value_ends_there_on_cuda():
    """The row kernels have no second output yet: the pre-norm block's first chain fuses up to the
    residual sum (read twice) and the report says why it stops there; the next block's chain,
    which reads the sum, fuses in full."""
    report = check_against_eager(PreNormBlock, three_d, device="cuda", grads=True, draws=2)
    first, second = report.rows
    assert first.status == "partial" and first.fused == ["linear", "add"]
    assert "no second value" in first.reason
    assert second.status == "fused"
