"""A training BatchNorm through the in-GEMM back end (fxg::ColumnMoments, csrc/gemm_batch_norm.cuh)
on a Hopper GPU.

The GEMM's epilogue stores the norm's input once and takes per (16-row strip, column) moments of
it from the float32 accumulators, storing the input as its deviation from its strip's mean (so
its rounding costs 2^-9 of the normalized value, not 2^-9 of the input's magnitude over the
column's spread, as eager's rounding does); a finalize merges each column's strips and one pass
normalizes in place and runs the rest of the chain. Each kernel of the production menu computes
S07's chain, and one of it in turn each other training BatchNorm chain of the suite, with the
batch statistics the op returns for the running statistics (mean, unbiased
variance), under the correctness rule: M of two rows up to many strips, strips cut short by M,
N not a multiple of the tile, bfloat16, float16 and float32 as TF32, a widening chain, operands
of the output's shape before the norm. NaN and infinities reach eager's columns; values far from
zero keep their variance; one row and 3-D inputs are not the module's (eager's error, or the row
path).
"""

from __future__ import annotations

import math

import pytest
import torch

import fxfuse.cuda as fxcuda
from fxfuse import reference
from fxfuse.ir import Gemm, Norm, Program
from gemm_harness import (Modules, assert_under_rule, draw, kernels, on_checking_menus, run_config_outputs, truth,
                          truth_statistics)
from programs import PROGRAMS

PROGRAMS_BN = {
    "s07": PROGRAMS["s07_vec_batch_train"],
    "s03": PROGRAMS["s03_batch_train_gelu_relu"],
    "s18": PROGRAMS["s18_batch_train_scalar_silu"],
    "residual": PROGRAMS["full_residual_batch_train"],
    "widen_s07": PROGRAMS["widen_s07_vec_batch_train"],
    "plain": Program(Gemm(False), (Norm("batch", 1e-3, training=True),)),
}
# S07 on the production menu, each kernel checked; the others on one kernel in turn
# (gemm_harness.checking_menu)
CASES = on_checking_menus({**{(name, torch.bfloat16): (p, torch.bfloat16) for name, p in PROGRAMS_BN.items()},
                           ("s07", torch.float16): (PROGRAMS_BN["s07"], torch.float16),
                           ("s07", torch.float32): (PROGRAMS_BN["s07"], torch.float32)},  # float32 as TF32
                          {("s07", torch.bfloat16)})
# (M, N, K): two rows (a column then normalizes to about +-d / sqrt(d^2 + 4 eps) of their
# difference d: eager's rounding of the norm's input moves it by up to one where d is a few ulp,
# the stored deviations by 2^-9); a strip cut short (7); a strip of one row (17: its deviation is
# 0, its spread 0); 300 rows = 18 strips and 12 rows, N past the tiles; four tiles of rows; 257
# strips (several merge ranges a column in the finalize)
SHAPES = [(2, 136, 72), (7, 520, 264), (17, 136, 72), (300, 1032, 520), (1024, 2048, 512), (4100, 264, 136)]


@pytest.fixture(autouse=True)
def tf32():
    """The float32 case is a TF32 GEMM: run while torch allows TF32 (tests/conftest.py restores it)."""
    torch.backends.cuda.matmul.allow_tf32 = True


@pytest.fixture(scope="module")
def modules(request):
    return Modules(request, CASES)


def assert_kernels_compute(module, program: Program, x, w, b, params, configs=None) -> None:
    """Each kernel's output and batch statistics (or those of ``configs``, configuration indices)
    obey the rule against eager's and the truth's."""
    eager_out, eager_stats = reference.op_forward(program, x, w, b, params, False)[:2]
    exact_out = truth(program, x, w, b, params)
    exact_stats = truth_statistics(program, x, w, b, params)
    for config in kernels(module) if configs is None else configs:
        out, stats = run_config_outputs(module, program, x, w, b, params, config)[:2]
        assert_under_rule(out, eager_out, exact_out)
        assert_under_rule(stats, eager_stats, exact_stats.to(stats.dtype))


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("name,dtype", list(CASES))
def test_every_kernel_normalizes_with_the_batch_statistics(modules, name, dtype, m, n, k):
    program = PROGRAMS_BN[name]
    for seed in range(5 if m * n < 1 << 20 else 1):
        assert_kernels_compute(modules[(name, dtype)], program, *draw(program, dtype, m, n, k, seed))


def test_every_schedule_keeps_each_strips_moments(modules):
    """Schedules reorder tiles, and a swizzle pads the tile grid past M and N with tiles of nothing:
    those must leave the strips' moments alone (700 rows: the last tile of rows cut short by M,
    N past the tiles)."""
    program, module = PROGRAMS_BN["s07"], modules[("s07", torch.bfloat16)]
    assert_kernels_compute(module, program, *draw(program, torch.bfloat16, 700, 1032, 264, seed=9),
                           configs=range(len(module.config_names)))


def test_nan_and_infinity_reach_the_columns_eager_puts_them_in(modules):
    """A NaN in a weight row makes that column's output NaN, an infinite bias another's (its
    variance is NaN), as eager's, and their statistics are not finite where eager's are not (NaN or
    infinite: the running statistics are lost either way); the other columns are untouched."""
    program = PROGRAMS_BN["s07"]
    module = modules[("s07", torch.bfloat16)]
    x, w, b, params = draw(program, torch.bfloat16, 300, 264, 72, seed=4)
    w[5, 3] = math.nan
    b[77] = math.inf
    b[130] = -math.inf
    eager_out, eager_stats = reference.op_forward(program, x, w, b, params, False)[:2]
    exact_out = truth(program, x, w, b, params)
    for config in kernels(module):
        out, stats = run_config_outputs(module, program, x, w, b, params, config)[:2]
        assert_under_rule(out, eager_out, exact_out)
        assert out[:, [5, 77, 130]].isnan().all() and out.isnan().sum() == 3 * 300
        assert torch.equal(stats.isfinite(), eager_stats.isfinite())


def test_values_far_from_zero_keep_their_variance(modules):
    """Columns of mean 1000 and variance about 1 (float32 as TF32, stored in float32): the strips'
    moments merge by Chan's formula, so the variance keeps float32's precision of the deviations,
    where E[x^2] - E[x]^2 would lose it to cancellation (an error near 1000^2 * 2^-24, 0.06)."""
    program = PROGRAMS_BN["s07"]
    module = modules[("s07", torch.float32)]
    x, w, b, params = draw(program, torch.float32, 1000, 264, 136, seed=6)
    params[0] = torch.ones_like(params[0])
    b = b + 1000.0
    for config in kernels(module):
        stats = run_config_outputs(module, program, x, w, b, params, config)[1]
        y = torch.nn.functional.linear(x.double(), w.double(), b.double())
        var, mean = torch.var_mean(y, dim=0, correction=1)
        torch.testing.assert_close(stats[1].double(), var, rtol=1e-2, atol=0)  # TF32 inputs: 2^-11
        torch.testing.assert_close(stats[0].double(), mean, rtol=1e-5, atol=0)


def test_one_row_is_not_the_modules_and_raises_eagers_error(modules):
    program = PROGRAMS_BN["s03"]
    module = modules[("s03", torch.bfloat16)]
    x, w, b, params = draw(program, torch.bfloat16, 1, 264, 72, seed=1)
    assert not any(module.supports(1, 264, 72, config) for config in range(len(module.config_names)))
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        fxcuda.engine.call(program.to_string(), x, w, b, params, gemm=module, config=0)


def test_a_three_dimensional_input_is_not_the_modules(modules):
    """torch's batch norm takes dim 1 of a 3-D value as its channels: the module covers 2-D x only,
    and the call goes where the row path and the reference decide (eager's error here)."""
    program = PROGRAMS_BN["s07"]
    module = modules[("s07", torch.bfloat16)]
    x, w, b, params = draw(program, torch.bfloat16, 16, 264, 72, seed=2, batch=(3,))
    assert fxcuda.engine.forward_kernels(program.to_string(), x, w, b, params, gemm=module, config=0) is None
    with pytest.raises(RuntimeError):
        fxcuda.engine.call(program.to_string(), x, w, b, params, gemm=module, config=0)
