"""Dropout with p > 0 in training fuses into the chain (a ``dropout`` stage): masks can't equal
eager's, so they are tested for what dropout means — each element kept with probability 1 - p and
scaled by 1 / (1 - p), a new mask on every call, the same mask in the backward, reproducible under
``torch.manual_seed`` — and eval mode stays eager's identity. The kernels compute the reference's
mask bit for bit (tests/gpu/test_emulated_cpu.py, the dropout programs)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import fxfuse
from fxfuse import masks
from support import check_against_eager, compile_fxfuse

ROWS, K, N = 64, 32, 512


class DenseDropout(nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.dense = nn.Linear(K, N)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return self.drop(self.dense(x))


class BertOutput(nn.Module):
    """transformers' BertOutput: dense, dropout, + residual, LayerNorm."""

    def __init__(self, p: float = 0.1):
        super().__init__()
        self.dense = nn.Linear(K, N)
        self.dropout = nn.Dropout(p)
        self.LayerNorm = nn.LayerNorm(N, eps=1e-12)

    def forward(self, h, x):
        return self.LayerNorm(self.dropout(self.dense(h)) + x)


def _run(model: nn.Module, *inputs: torch.Tensor):
    fxfuse.reset_report()
    out = compile_fxfuse(model)(*inputs)
    return out, fxfuse.last_report()


def _zero_fraction_bound(p: float, count: int) -> float:
    """Five standard deviations of the dropped fraction of ``count`` elements."""
    return 5 * math.sqrt(p * (1 - p) / count)


def test_dropout_in_training_fuses_into_the_chain():
    model = BertOutput().train()
    _, report = _run(model, torch.randn(2, 8, K), torch.randn(2, 8, N))
    (row,) = report.rows
    assert row.status == "fused"
    assert "dropout(p=0.1, seed=p0)" in row.program


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_each_element_is_kept_with_probability_one_minus_p_and_scaled(p):
    torch.manual_seed(0)
    model = DenseDropout(p).train()
    x = torch.randn(ROWS, K)
    out, report = _run(model, x)
    assert report.rows[0].status == "fused"
    y = model.dense(x).detach()
    dropped = out == 0
    assert abs(dropped.float().mean().item() - p) < _zero_fraction_bound(p, dropped.numel())
    torch.testing.assert_close(out[~dropped], y[~dropped] * masks.scale(p))


def test_the_backward_drops_the_same_elements():
    torch.manual_seed(0)
    model = DenseDropout(0.5).train()
    x = torch.randn(ROWS, K, requires_grad=True)
    grad = torch.randn(ROWS, N)
    out, _ = _run(model, x)
    out.backward(grad)
    kept = (out != 0).float().detach()
    reference = DenseDropout(0.5)
    reference.load_state_dict(model.state_dict())
    x_ref = x.detach().clone().requires_grad_()
    (reference.dense(x_ref) * kept * masks.scale(0.5)).backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(model.dense.weight.grad, reference.dense.weight.grad)
    torch.testing.assert_close(model.dense.bias.grad, reference.dense.bias.grad)


def test_every_call_draws_a_new_mask_and_manual_seed_reproduces_a_run():
    model = DenseDropout(0.5).train()
    compiled = compile_fxfuse(model)
    x = torch.randn(ROWS, K)
    torch.manual_seed(1)
    first, second = compiled(x), compiled(x)
    assert not torch.equal(first == 0, second == 0)
    torch.manual_seed(1)
    assert torch.equal(compiled(x), first)


def test_eval_mode_is_the_identity_as_in_eager():
    report = check_against_eager(lambda: BertOutput(0.3), lambda: [torch.randn(2, 8, K), torch.randn(2, 8, N)],
                                 train=False)
    assert [r.status for r in report.rows] == ["fused"]
    assert "dropout" not in report.rows[0].program


def test_a_nan_stays_nan_where_its_element_is_dropped():
    """eager's dropout multiplies by the mask: NaN * 0 is NaN."""
    torch.manual_seed(0)
    model = DenseDropout(0.5).train()
    x = torch.randn(ROWS, K)
    x[3, 0] = float("nan")
    out, _ = _run(model, x)
    assert out[3].isnan().all() and not out[[0, 1, 2, 4]].isnan().any()


@pytest.mark.parametrize("p,inplace,reason", [(1.0, False, "dropout with p=1.0"), (0.2, True, "inplace=True")])
def test_p_of_one_and_inplace_dropout_are_left_unfused_with_the_reason(p, inplace, reason):
    torch._dynamo.reset()  # a float attribute that changes between compiles becomes symbolic
    model = nn.Sequential(nn.Linear(K, N), nn.Dropout(p, inplace=inplace)).train()
    _, report = _run(model, torch.randn(4, K))
    assert report.rows[0].status == "not_fused" and reason in report.rows[0].reason


def test_masks_are_independent_across_rows_and_columns():
    """The hash's bits look like independent coin flips: every row and column keeps about 1 - p,
    neighbouring elements (along a row, down a column) are uncorrelated, and two seeds give
    uncorrelated masks."""
    m, n, p = 1024, 1024, 0.5
    seed = torch.tensor([12345, 67890])
    mask = masks.keep_mask(seed, m, n, p).float()
    bound = _zero_fraction_bound(p, n) * 1.5  # over 1024 rows, a little past 5 sigma
    assert (mask.mean(1) - (1 - p)).abs().max() < bound
    assert (mask.mean(0) - (1 - p)).abs().max() < bound
    centred = mask - mask.mean()

    def correlation(a, b):
        return ((a * b).mean() / (a.pow(2).mean().sqrt() * b.pow(2).mean().sqrt())).abs().item()

    assert correlation(centred[:, 1:], centred[:, :-1]) < 0.01
    assert correlation(centred[1:], centred[:-1]) < 0.01
    other = masks.keep_mask(torch.tensor([12346, 67890]), m, n, p).float()
    assert correlation(centred, other - other.mean()) < 0.01
