"""Comparisons of the chain's values, ``torch.where`` and ``masked_fill`` join the chain.

A comparison (``y > 0``, ``torch.lt(y, t)``, against a number or a per-column vector) is a mask of
1s and 0s inside the expression; ``torch.where(c, a, b)`` is ``pick(c, a) + pick(1 - c, b)``, so
an infinite or NaN value not picked never reaches the result; ``masked_fill(c, v)`` is
``where(c, v, y)``. No gradient flows through a comparison, none to the condition. A chain never
ends at a comparison's bool value.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from support import check_against_eager

K, N = 24, 48


class WhereLeaky(nn.Module):
    """LeakyReLU written with torch.where."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(K, N)

    def forward(self, x):
        y = self.proj(x)
        return torch.where(y > 0, y, 0.2 * y)


class MaskMultiplied(nn.Module):
    """A mask multiplied in, against a per-column threshold, then masked_fill of a floor."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(K, N, bias=False)
        self.threshold = nn.Parameter(torch.randn(N))

    def forward(self, x):
        y = self.proj(x)
        kept = y * (y < self.threshold)
        return kept.masked_fill(kept <= -0.5, -0.5) * 2.0


class WhereOfTwoBranches(nn.Module):
    """Both branches computed from the chain; where's branches of an infinite value unpicked."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(K, N)

    def forward(self, x):
        y = self.proj(x)
        return torch.where(torch.ge(y, 0.5), torch.exp(y * 20.0), torch.sigmoid(y)) + 1.0


class WhereMethod(nn.Module):
    """The method form: ``y.where(c, other)`` keeps y where c holds."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(K, N)

    def forward(self, x):
        y = self.proj(x)
        return y.where(y < 1.0, 1.0 + 0.1 * y)


def _inputs():
    x = torch.randn(16, K)
    x[3, 5] = float("nan")  # a NaN row: NaN wherever eager's is
    return [x]


@pytest.mark.parametrize("model", [WhereLeaky, MaskMultiplied, WhereOfTwoBranches, WhereMethod],
                         ids=["where_leaky", "mask_multiplied", "two_branches", "where_method"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_a_chain_with_comparisons_fuses_in_full_and_computes_eagers_values_and_gradients(model, train):
    report = check_against_eager(model, _inputs, train=train, grads=train)
    (row,) = report.rows
    assert row.status == "fused", row.reason
    assert "pick(" in row.program or "lt(" in row.program


def test_in_bfloat16_comparisons_read_the_rounded_values():
    (row,) = check_against_eager(WhereLeaky, _inputs, dtype=torch.bfloat16, train=False).rows
    assert row.status == "fused"


def test_the_infinite_branch_not_picked_leaves_no_nan():
    torch.manual_seed(0)
    model = WhereOfTwoBranches()
    x = torch.randn(64, K) * 10
    from support import compile_fxfuse

    out = compile_fxfuse(model)(x)
    assert torch.isinf(model(x)).any() == torch.isinf(out).any()
    torch.testing.assert_close(out, model(x))


class MaskReturned(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(K, N)

    def forward(self, x):
        y = torch.relu(self.proj(x))
        return y, y > 0.5


class ConditionFromOutside(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(K, N)

    def forward(self, x, keep):
        return torch.where(keep, torch.relu(self.proj(x)), 0.0)


def test_a_returned_mask_is_left_outside_the_chain():
    """The chain ends before the comparison (partial: a mask is no float value the op can return);
    the comparison runs on the op's output."""
    (row,) = check_against_eager(MaskReturned, _inputs, train=False).rows
    assert row.status == "partial" and row.program.endswith("pointwise(relu(x))")


def test_a_condition_computed_outside_the_chain_stops_it_with_the_reason():
    (row,) = check_against_eager(ConditionFromOutside, lambda: [torch.randn(16, K), torch.rand(16, N) > 0.5],
                                 train=False).rows
    assert row.status == "partial" and "torch.bool" in row.reason
