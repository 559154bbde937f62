"""Real-model spellings on CUDA: GPT-2's Conv1D (a weight stored (K, N)), views that regroup rows
and operands of the output's shape (a residual, a gate: read by the row kernels at each element's
own position), a second output (keep(): a residual sum the graph reads twice), a gated MLP written
with the up projection first and a row reduction broadcast back run in the fused kernels and equal
eager, outputs and gradients."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: support, test_operands

from support import check_against_eager  # noqa: E402
from test_operands import (B, K, N, T, BertOutput, BroadcastBack, Conv1DBlock, PositionEmbedding,  # noqa: E402
                           PreNormBlock, UpFirstSwiGLU, three_d, x_alone)

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


# The models the tests below compile, with their inputs, in float32 and bfloat16: tests/gpu/prebuild.py
# builds their modules (each would otherwise build in its test, minutes of CUTLASS for a GEMM module)
MODELS = [(Conv1DMlp, x_alone), (BertOutput, three_d), (Conv1DBlock, three_d), (PositionEmbedding, x_alone),
          (PreNormBlock, three_d), (UpFirstSwiGLU, x_alone), (BroadcastBack, x_alone)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_a_conv1d_block_fuses_on_cuda(dtype, train):
    report = check_against_eager(Conv1DMlp, x_alone, dtype=dtype, device="cuda",
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_an_operand_broadcast_along_the_batch_fuses_on_cuda(train, dtype):
    """A (T, N) position embedding added to the (B, T, N) projection: the row kernels read it where
    it is (output row r at its row r mod T), the in-GEMM epilogue (which loads M x N values by TMA)
    an expanded copy; its gradient sums over the batch."""
    report = check_against_eager(PositionEmbedding, x_alone, dtype=dtype, device="cuda", train=train, grads=train,
                                 draws=3)
    (row,) = report.rows
    assert row.status == "fused" and row.program.endswith("|| full col col")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_a_chain_that_returns_a_second_value_fuses_on_cuda(train, dtype):
    """The pre-norm block: the residual sum is stored by the row kernel as the op's second output
    and normalised in the same pass; the next chain reads it as its residual."""
    report = check_against_eager(PreNormBlock, three_d, dtype=dtype, device="cuda", train=train, grads=train, draws=3)
    first, second = report.rows
    assert first.status == "fused" and "keep()" in first.program
    assert second.status == "fused"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_a_gated_mlp_with_the_up_projection_first_fuses_on_cuda(train, dtype):
    """up(x) * silu(gate(x)): one op, the activation on its second GEMM (row path, and the in-GEMM
    kernels where the selection takes them)."""
    report = check_against_eager(UpFirstSwiGLU, x_alone, dtype=dtype, device="cuda",
                                 train=train, grads=train, draws=3)
    up, gate, _ = report.rows
    assert up.status == gate.status == "fused" and "silu(p0)" in up.program


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_a_reduced_value_broadcast_back_fuses_on_cuda(train, dtype):
    """mean(relu(y), keepdim) * w + b, then sigmoid: the row kernels fill the row with the mean."""
    report = check_against_eager(BroadcastBack, x_alone, dtype=dtype, device="cuda",
                                 train=train, grads=train, draws=3)
    (row,) = report.rows
    assert row.status == "fused" and "mean(keepdim=True)" in row.program
