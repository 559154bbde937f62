"""Pooling along the features on CUDA (KernelBench's max_pool1d / avg_pool1d of the rows viewed as
one channel): through torch.compile the chain fuses in full, the row kernels pool (through shared
memory) and what follows runs on the narrower row; outputs and gradients equal eager's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: support

from support import check_against_eager  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

M, K, N = 128, 256, 1024


class MaxPoolSumScale(nn.Module):
    """KernelBench's Matmul_MaxPool_Sum_Scale: one value a row."""

    def __init__(self):
        super().__init__()
        self.linear, self.pool = nn.Linear(K, N), nn.MaxPool1d(2)

    def forward(self, x):
        return self.pool(self.linear(x).unsqueeze(1)).squeeze(1).sum(dim=1) * 0.5


class AvgPoolGeluRows(nn.Module):
    """Overlapping windows and a row of the pooled width as the output (odd: the scalar stores)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(K, N)

    def forward(self, x):
        return F.gelu(F.avg_pool1d(torch.sigmoid(self.linear(x)).unsqueeze(1), 3, stride=2).squeeze(1)) * 2.0


def x_rows():
    return [torch.randn(M, K)]


# The models the tests below compile, with their inputs, in float32 and bfloat16: tests/gpu/prebuild.py
# builds their modules
MODELS = [(MaxPoolSumScale, x_rows), (AvgPoolGeluRows, x_rows)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("model", [MaxPoolSumScale, AvgPoolGeluRows], ids=["max_sum", "avg_rows"])
def test_a_pooling_chain_fuses_and_runs_in_the_row_kernels(model, train, dtype):
    report = check_against_eager(model, x_rows, dtype=dtype, device="cuda",
                                 train=train, grads=train, draws=3)
    (row,) = report.rows
    assert row.status == "fused" and "_pool(kernel=" in row.program, report
    assert row.path.startswith("cuBLAS + row pass"), row.path
