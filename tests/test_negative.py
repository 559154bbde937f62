"""What must not fuse, and errors that must be eager's."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from support import check_against_eager, compile_fxfuse
from test_spellings import Chain, K, M, N, _inputs


def _row(epilogue, inputs=_inputs(), dtype=torch.float32):
    report = check_against_eager(lambda: Chain(epilogue), inputs, dtype=dtype)
    return report.rows[0]


def test_an_intermediate_read_outside_the_chain_is_returned_not_fused_away():
    """``a`` is read by the chain (relu) and by a full sum outside it: the op returns it too (a
    keep() stage); the full sum, which is no row reduction, ends the chain."""
    def epilogue(m, y):
        a = y * 2.0
        b = torch.relu(a)
        return b + a.sum()  # a is also read by sum

    row = _row(epilogue)
    assert row.status == "partial" and row.fused[-1] == "relu"
    assert "keep()" in row.program and row.reason == "sum over every dim"


def test_the_gemm_value_read_twice_outside_stays_unfused():
    row = _row(lambda m, y: torch.relu(y) + y.mean())
    assert row.status in ("partial", "not_fused")


def test_group_norm_on_a_3d_value_is_not_a_feature_norm():
    row = _row(lambda m, y: F.group_norm(y, 2), inputs=_inputs((2, 4, K)))
    assert row.status == "not_fused"
    assert "dim 1" in row.reason


def test_batch_norm_on_a_3d_value_is_not_a_feature_norm():
    bn = nn.BatchNorm1d(4)
    row = _row(lambda m, y: F.batch_norm(y, None, None, training=True), inputs=_inputs((2, 4, K)))
    assert row.status == "not_fused" and "dim 1" in row.reason
    del bn


def test_float64_is_left_to_inductor():
    row = _row(lambda m, y: torch.relu(y), dtype=torch.float64)
    assert row.status == "not_fused" and "float64" in row.reason


def test_groups_not_dividing_n_raise_eagers_error():
    model = Chain(lambda m, y: F.group_norm(y, 5))
    x = torch.randn(M, K)
    with pytest.raises(RuntimeError) as eager_error:
        model(x)
    with pytest.raises(Exception) as compiled_error:
        compile_fxfuse(model)(x)
    assert "divisible" in str(eager_error.value) and "divisible" in str(compiled_error.value)


def test_cpu_tensors_are_not_fused_without_allow_cpu():
    import fxfuse

    model = Chain(lambda m, y: torch.relu(y))
    x = torch.randn(M, K)
    torch.testing.assert_close(torch.compile(model, backend="fxfuse")(x), model(x))
    (row,) = fxfuse.last_report().rows
    assert row.status == "not_fused" and "allow_cpu" in row.reason


def test_a_parameter_that_would_broadcast_the_output_is_not_fused():
    class Odd(Chain):
        def __init__(self):
            super().__init__(lambda m, y: y * m.odd)
            self.odd = nn.Parameter(torch.randn(3, 1, N))

    report = check_against_eager(Odd, _inputs())
    assert report.rows[0].status == "not_fused" and "broadcast" in report.rows[0].reason


def test_batch_norm_training_with_one_row_raises_eagers_error():
    model = Chain(lambda m, y: F.batch_norm(y, m.running_mean, m.running_var, training=True))
    x = torch.randn(1, K)
    with pytest.raises(ValueError):
        model(x)
    with pytest.raises(Exception, match="more than 1 value per channel"):
        compile_fxfuse(model)(x)


def test_mismatched_dtypes_raise_eagers_error():
    model = Chain(lambda m, y: torch.relu(y))
    x = torch.randn(M, K, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError):
        model(x)
    with pytest.raises(Exception):
        compile_fxfuse(model)(x)


def test_softmax_over_the_batch_dim_is_not_fused():
    row = _row(lambda m, y: F.softmax(y, dim=0))
    assert row.status == "not_fused" and "not the feature dim" in row.reason


def test_a_cast_to_another_narrow_dtype_ends_the_chain():
    """Back to the chain's own dtype after widening is a rounding point (narrow(), fused: see
    test_spellings); to a third dtype it is not."""
    row = _row(lambda m, y: (y.float() * 2.0).to(torch.float16), dtype=torch.bfloat16)
    assert row.status == "partial" and row.fused == ["linear", "float", "mul(2.0)"]
    assert "float16" in row.reason


def test_a_norm_of_the_gemms_dtype_after_the_chain_widened_ends_the_chain():
    """A bf16 norm that comes after the chain widened (here on the GEMM output itself) is not
    fused into it; the result is still eager's."""
    def epilogue(m, y):
        wide = y.float() * 2.0
        return wide + F.layer_norm(y, (N,)).float()

    row = _row(epilogue, dtype=torch.bfloat16)
    assert row.status in ("partial", "not_fused") and "layer_norm" not in row.fused


@pytest.mark.parametrize("pool,why", [
    (lambda y: F.avg_pool1d(y.unsqueeze(1), kernel_size=4, padding=1).squeeze(1), "padding 1 is not fused"),
    (lambda y: nn.MaxPool1d(3, stride=4, ceil_mode=True)(y.unsqueeze(1)).squeeze(1), "ceil_mode is not fused"),
    (lambda y: F.max_pool1d(y.unsqueeze(1), 2, dilation=2).squeeze(1), "dilation or return_indices is not fused"),
    (lambda y: F.adaptive_avg_pool1d(y.unsqueeze(1), 5).squeeze(1), "(windows of unequal size) is not fused"),
], ids=["padding", "ceil_mode", "dilation", "adaptive-unequal"])
def test_pooling_windows_past_the_row_or_with_gaps_stop_the_chain_and_say_why(pool, why):
    row = _row(lambda m, y: torch.relu(pool(torch.sigmoid(y))))
    assert row.status == "partial" and row.fused[-1] == "sigmoid"
    assert "pool1d along the features (of unsqueeze): " in row.reason and why in row.reason


def test_a_norm_after_a_pooling_ends_the_chain_at_the_pooling():
    row = _row(lambda m, y: F.layer_norm(F.avg_pool1d(y.unsqueeze(1), 2).squeeze(1), (N // 2,)))
    assert row.status == "partial" and row.fused[-1] == "avg_pool1d(2)" and row.reason == "a norm after a pooling"
