"""The shipped kernels and runtime, run by the host emulator on CPU tensors, against the reference.

Everything but the CUDA-specific lines runs here: the generated program modules — forward and, for
pointwise and norm programs, backward kernels — (compiled as host
C++ with FX_EMULATE: every CUDA thread a fiber, barriers and shuffles checked for divergence), the
launch plans, the runtime binding (GEMM, parameters, outputs, workspace). Each call writes into a
NaN-filled buffer, so an element the kernels skip shows up, and asserts the kernels ran (no
fallback). Builds are cached (FXFUSE_CACHE_DIR or ~/.cache/fxfuse); the first run compiles a few
dozen small modules (set FXFUSE_SKIP_EMULATOR=1 to skip this file).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil

import pytest
import torch

from fxfuse import expr as E
from fxfuse import reference
from fxfuse.cuda.build import BuildError, cache_root, emulate_target
from fxfuse.cuda.engine import Engine
from fxfuse.ir import Gemm, Norm, Program
from fxfuse.vocabulary import call
from progress import shown
from programs import (LOW_PRECISION, PROGRAMS, REDUCTION_EDGES, ZERO_ROW_NORMS, assert_backward_close, dtypes_of, fits,
                      grad_cases, make_params, poison, pw, reduction_edges, rows_of_zeros)

SHAPES = [(7, 1000, 300), (1, 64, 16), (5, 256, 16), (3, 4096, 8), (4, 3, 8), (6, 24, 5)]
EXTRA = ["s16_sigmoid_sum", "s04_group_silu_vec_silu", "group_odd", "s03_batch_train_gelu_relu",
         "widen_s08_silu_vec_group", "full_residual_layer", "full_residual", "gelu_dropout",
         "pool_max_sum_scale", "pool_avg_overlapping_rows"]  # widest rows
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}


@pytest.fixture(scope="module")
def engine(request):
    if os.environ.get("FXFUSE_SKIP_EMULATOR"):
        pytest.skip("FXFUSE_SKIP_EMULATOR is set")
    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("needs a host C++ compiler")
    try:
        target = emulate_target()
    except BuildError as error:
        pytest.skip(str(error))
    engine = Engine(lambda device: target)
    pairs = {(PROGRAMS[c.values[0]], c.values[1]) for c in cases()}
    pairs |= {(PROGRAMS[name], dtype) for name in EXTRA for dtype in (torch.float32, torch.bfloat16)}
    what = (f"fxfuse: compiling {len(pairs)} emulator modules (host C++, in parallel; cached in {cache_root()}, "
            "so only a first run pays; FXFUSE_SKIP_EMULATOR=1 skips this file)")
    with shown(request, what):
        failed = engine.prepare_many(sorted(pairs, key=str), torch.device("cpu"))  # parallel builds
    assert not failed, failed
    return engine


def inputs(program, dtype, m, n, k, seed, layout="contiguous"):
    g = torch.Generator().manual_seed(seed)
    if layout == "transposed":
        x = torch.randn(k, m, generator=g).t()
    elif layout == "3d":
        x = torch.randn(2, m, k, generator=g)
    else:
        x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / math.sqrt(k)
    b = torch.randn(n, generator=g) if program.gemm.bias else None
    params = make_params(program, n, dtype=dtype, generator=g, lead=tuple(x.shape[:-1]), k=k)
    cast = (lambda t: None if t is None else t.to(dtype))
    return cast(x), cast(w), cast(b), params


@contextlib.contextmanager
def norms_as_on_cuda(dtype):
    """torch's CPU norms of bfloat16/float16 tensors form some intermediates in that dtype (CPU
    batch_norm's scale and shift, e.g.), its CUDA kernels compute in float32 and round the result.
    The kernels follow CUDA; on CPU the oracle's norms do the same: float32 math on the input
    rounded to ``dtype``, output rounded to ``dtype``."""
    original = reference._norm
    if dtype == torch.float32:
        yield
        return

    def norm(stage, v, params, out_dtype):
        out, stats = original(stage, v.to(out_dtype).float(), [q.float() for q in params], torch.float32)
        return out.to(out_dtype).float(), stats

    reference._norm = norm
    try:
        yield
    finally:
        reference._norm = original


def run_and_compare(engine, program, dtype, x, w, b, params):
    text = program.to_string()
    with norms_as_on_cuda(dtype):
        ref_out, ref_stats, _, ref_kept = reference.op_forward(program, x, w, b, params, False)
    result = engine.forward_kernels(text, x, w, b, params)
    assert result is not None, "the kernels do not cover the call"
    out, stats, _, kept = result
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=tol, atol=tol, equal_nan=True)
    assert kept.dtype == ref_kept.dtype
    torch.testing.assert_close(kept.float(), ref_kept.float(), rtol=tol, atol=tol, equal_nan=True)
    assert stats.shape == ref_stats.shape and stats.dtype == torch.float32
    if ref_stats.numel():
        torch.testing.assert_close(stats, ref_stats, rtol=tol, atol=tol, equal_nan=True)
    return out, stats


def cases():
    for name, program in PROGRAMS.items():
        dtypes = dtypes_of(name)
        for dtype in dtypes:
            for m, n, k in SHAPES:
                if not fits(program, n) or (program.batch_norm_training and m < 2):
                    continue
                yield pytest.param(name, dtype, m, n, k, id=f"{name}-{str(dtype)[6:]}-{m}x{k}x{n}")


@pytest.mark.parametrize("name,dtype,m,n,k", list(cases()))
def test_program_matches_reference(engine, name, dtype, m, n, k):
    program = PROGRAMS[name]
    for seed in range(2):
        run_and_compare(engine, program, dtype, *inputs(program, dtype, m, n, k, seed))


@pytest.mark.parametrize("name", ["group_odd", "s21_rms_silu", "s11_gelu_softmax", "s03_batch_train_gelu_relu",
                                  "full_residual_layer", "keep_residual_layer", "dropout_residual_layer",
                                  "pool_max_rows", "pool_avg_overlapping_rows"])
def test_rows_off_a_16_byte_boundary_take_the_scalar_kernels(engine, name):
    """N = 290 float32 values: every other row starts 8 bytes off a 16-byte boundary, and the
    kernels load and store one element at a time."""
    program = PROGRAMS[name]
    run_and_compare(engine, program, torch.float32, *inputs(program, torch.float32, 5, 290, 16, 0))


@pytest.mark.parametrize("n", [256, 260], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ["widen_s08_silu_vec_group", "widen_s09_vec_relu", "widen_s20_layer_silu",
                                  "widen_s05_logsumexp_chain"])
def test_a_chain_that_widens_writes_float32(engine, name, dtype, n):
    """A bfloat16/float16 chain that widens stores float32: a pointwise or reduction chain loads
    chunks of 4 values (8 bytes) and stores each as one 16-byte vector, a norm chain loads 16
    bytes and stores two; one element at a time where rows are not 16-byte aligned (N = 260)."""
    program = PROGRAMS[name]
    out, _ = run_and_compare(engine, program, dtype, *inputs(program, dtype, 5, n, 16, 7))
    assert out.dtype == torch.float32


@pytest.mark.parametrize("name,n", [("s20_layer_silu", 256), ("s20_layer_silu", 260), ("full_residual_layer", 256),
                                    ("full_residual_layer", 260), ("s04_group_silu_vec_silu", 256)])
def test_parameters_of_the_modules_dtype_and_of_float32_give_the_same_rows(engine, name, n):
    """Where every column and full parameter of a call is of the module's dtype the kernels read
    them by typed loads; where one is float32 (here the same values) they convert each by its
    dtype. Both compute on the same float values: the same output to the bit (rows of whole
    16-byte chunks, N = 256, and not, N = 260)."""
    program = PROGRAMS[name]
    text = program.to_string()
    x, w, b, params = inputs(program, torch.bfloat16, 5, n, 16, 4)
    assert all(p.dtype == torch.bfloat16 for p in params)
    typed = engine.forward_kernels(text, x, w, b, params)
    converted = engine.forward_kernels(text, x, w, b, [params[0].float(), *params[1:]])
    assert typed is not None and converted is not None, "the kernels do not cover the call"
    assert torch.equal(typed[0], converted[0])


@pytest.mark.parametrize("name", EXTRA)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_widest_rows(engine, name, dtype):
    """N = 32768: 512 threads a row, 64 values a thread (32765 for the odd group sizes)."""
    program = PROGRAMS[name]
    n = 32765 if name == "group_odd" else 32768
    run_and_compare(engine, program, dtype, *inputs(program, dtype, 2, n, 4, 0))


@pytest.mark.parametrize("name", ["full_residual", "s04_group_silu_vec_silu", "gelu_dropout"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_cut_into_uneven_segments(engine, name, dtype):
    """N = 11008 (Llama's FFN width): more chunks than one 256-thread segment holds and not a
    multiple of it; the row is spread evenly over its segments, every column written once."""
    program = PROGRAMS[name]
    run_and_compare(engine, program, dtype, *inputs(program, dtype, 3, 11008, 4, 0))


FEW_ROWS_PROGRAMS = ["s01_scale_leaky", "s04_group_silu_vec_silu", "s22_batch_eval_relu", "gelu_dropout",
                     "rotary_heads", "full_residual"]


@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name,n", [(name, n) for name in FEW_ROWS_PROGRAMS for n in (2048, 2056)
                                    if fits(PROGRAMS[name], n)])
def test_rows_too_few_to_fill_the_device_are_cut_into_smaller_segments(engine, name, n, dtype, m):
    """Fewer row segments than the device has SMs (the emulator's four): a row-local program takes
    one chunk a thread and each row in segments of 256 threads down to a warp, one a block,
    until the grid covers the SMs (2048 bf16 columns: one segment a row at 256 threads, then two
    of 128, four of 64; 2056: segments of uneven width, the last one part empty). Every column is
    written once, with its own parameters, groups, heads and dropout draws."""
    program = PROGRAMS[name]
    run_and_compare(engine, program, dtype, *inputs(program, dtype, m, n, 8, m))


@pytest.mark.parametrize("layout", ["transposed", "3d"])
@pytest.mark.parametrize("name", ["s02_group_leaky_double", "s20_layer_silu", "reduce_logsumexp_drop", "reduce_sum_keep",
                                  "full_residual", "full_residual_layer", "keep_residual_layer",
                                  "dropout_residual_layer"])
def test_input_layouts(engine, name, layout):
    program = PROGRAMS[name]
    if layout == "3d" and name == "s02_group_leaky_double":
        # torch's group norm takes dim 1 of a 3-D input as channels: the reference runs (and raises)
        with pytest.raises(RuntimeError, match="divisible by num_groups"):
            engine.call(program.to_string(), *inputs(program, torch.float32, 5, 1000, 12, 1, layout))
        return
    run_and_compare(engine, program, torch.float32, *inputs(program, torch.float32, 5, 1000, 12, 1, layout))


@pytest.mark.parametrize("layout", ["contiguous", "3d"])
@pytest.mark.parametrize("name", ["gemm_gate_silu", "gemm_up_first_silu", "gemm_gate_gelu_scaled"])
def test_a_gated_pair_saves_both_gemm_outputs_for_the_backward(engine, name, layout):
    """A call that keeps its GEMM output (training) computes the GEMM and the second GEMM into one
    stacked tensor, (2, *rows, N), the op's saved output: the reference's, and the chain's output
    from it."""
    program = PROGRAMS[name]
    x, w, b, params = inputs(program, torch.bfloat16, 5, 256, 16, 3, layout)
    out, _, saved, _ = engine.call(program.to_string(), x, w, b, params, save_gemm=True)
    ref_out, _, ref_saved, _ = reference.op_forward(program, x, w, b, params, True)
    assert saved.shape == ref_saved.shape == (2, *x.shape[:-1], 256)
    torch.testing.assert_close(saved, ref_saved, rtol=0, atol=0)
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=TOL[torch.bfloat16], atol=TOL[torch.bfloat16])


@pytest.mark.parametrize(
    "name",
    ["s02_group_leaky_double", "s20_layer_silu", "s21_rms_silu", "s11_gelu_softmax", "log_softmax_then_pointwise",
     "reduce_max_drop", "reduce_min_keep", "reduce_logsumexp_keep", "reduce_vector_norm_drop", "normalize_then_col", "reduce_std_drop",
     "s03_batch_train_gelu_relu",
     "s22_batch_eval_relu", "group_odd", "vocabulary_2", "full_residual_layer", "full_gate_silu", "pool_max_rows", "pool_max_sum_scale",
     "pool_avg_gelu_scale_max"],  # vocabulary_1: gelu's CPU kernel differs at inf
)
def test_nan_inf_propagate(engine, name):
    """NaN in an input row, NaN/Inf in weight rows and bias: every stage propagates as torch does."""
    program = PROGRAMS[name]
    x, w, b, params = inputs(program, torch.float32, 6, 1000, 8, 2)
    poison(x, w, b)
    run_and_compare(engine, program, torch.float32, x, w, b, params)


@pytest.mark.parametrize("layout", ["transposed", "misaligned", "float32", "3d", "broadcast_rows",
                                    "broadcast_rows_kept_dim", "broadcast_rows_float32"])
def test_an_operand_of_the_outputs_shape_in_any_layout_is_read_at_each_elements_position(engine, layout):
    """A residual that is a transposed view, starts off a 16-byte boundary, is float32 beside a
    bfloat16 GEMM, is (B, T, N) against a 3-D x, or (T, N) or (1, T, N) broadcast along its batch
    (which the row kernels read where it is, output row r at its row r mod T): the runtime hands
    the kernels a contiguous, aligned copy where it must, and each element reads its own value."""
    program = PROGRAMS["full_residual_layer"]
    dtype = torch.bfloat16
    three_d = layout == "3d" or layout.startswith("broadcast_rows")
    x, w, b, (residual, *cols) = inputs(program, dtype, 5, 256, 16, 3, "3d" if three_d else "contiguous")
    if layout == "broadcast_rows":
        residual = residual[0]  # (T, N) of x's (2, T, K)
    elif layout == "broadcast_rows_kept_dim":
        residual = residual[1:2]  # (1, T, N)
    elif layout == "broadcast_rows_float32":
        residual = residual[1].float()
    elif layout == "transposed":
        residual = residual.t().contiguous().t()
    elif layout == "misaligned":
        residual = torch.cat([residual.new_zeros(1), residual.flatten()])[1:].view(residual.shape)
    elif layout == "float32":
        residual = residual.float()
    run_and_compare(engine, program, dtype, x, w, b, [residual, *cols])


@pytest.mark.parametrize("shape", ["per_row", "per_sample", "per_row_float32"])
def test_a_per_row_operand_is_read_once_a_row(engine, shape):
    """One value a row of a 3-D x's (2, m) rows: (2, m, 1), or (2, 1, 1) one a sample, which the
    runtime expands; in the kernels' dtype or float32 beside a bfloat16 GEMM; before and after a
    row reduction."""
    for name in ("row_scale_gelu", "row_after_sum"):
        program = PROGRAMS[name]
        x, w, b, (per_row, *rest) = inputs(program, torch.bfloat16, 5, 40, 16, 4, "3d")
        if shape == "per_sample":
            per_row = per_row[:, :1]
        elif shape == "per_row_float32":
            per_row = per_row.float()
        run_and_compare(engine, program, torch.bfloat16, x, w, b, [per_row, *rest])


def test_all_minus_inf_rows(engine):
    """logsumexp of a row of -inf is -inf; max of it -inf; softmax of it NaN (as torch)."""
    for name in ["reduce_logsumexp_drop", "reduce_max_keep", "s11_gelu_softmax"]:
        program = PROGRAMS[name]
        x, w, b, params = inputs(program, torch.float32, 3, 64, 4, 0)
        b = torch.full_like(b, -math.inf)
        w = torch.zeros_like(w)
        run_and_compare(engine, program, torch.float32, x, w, b, params)


def test_batch_norm_training_one_row_raises_like_eager(engine):
    program = PROGRAMS["s03_batch_train_gelu_relu"]
    x, w, b, params = inputs(program, torch.float32, 1, 64, 8, 0)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        engine.call(program.to_string(), x, w, b, params)


def test_group_norm_indivisible_raises_like_eager(engine):
    program = PROGRAMS["s02_group_leaky_double"]
    x, w, b, params = inputs(program, torch.float32, 3, 66, 8, 0)
    with pytest.raises(RuntimeError):
        engine.call(program.to_string(), x, w, b, params)


def test_batch_stats_equal_var_mean(engine):
    program = PROGRAMS["s07_vec_batch_train"]
    x, w, b, params = inputs(program, torch.float32, 37, 200, 16, 3)
    _, stats = run_and_compare(engine, program, torch.float32, x, w, b, params)
    pre = torch.nn.functional.linear(x, w, b) * params[0]
    var, mean = torch.var_mean(pre, dim=0, correction=1)
    torch.testing.assert_close(stats, torch.stack([mean, var]), rtol=1e-5, atol=1e-5)


def test_many_rows_batch_norm(engine):
    """More rows than the statistics kernel has chunks: chunks of several rows, Chan combine."""
    program = PROGRAMS["s18_batch_train_scalar_silu"]
    run_and_compare(engine, program, torch.float32, *inputs(program, torch.float32, 300, 16, 4, 4))


@pytest.mark.parametrize("dtype,m,n", [(torch.float32, 37, 1000), (torch.bfloat16, 3, 2056), (torch.bfloat16, 130, 264)])
def test_batch_norm_statistics_of_wide_rows_in_segments(engine, dtype, m, n):
    """The statistics kernel cuts a row-local program's rows into warp-wide segments, strips of
    rows over a block's lanes: a last segment of one chunk (2056 bf16 values: 257 chunks of 8),
    fewer rows than lanes (3), strips of uneven length (130 rows); the column parameter read at
    each segment's own columns; statistics equal torch.var_mean's."""
    program = PROGRAMS["s07_vec_batch_train"]
    x, w, b, params = inputs(program, dtype, m, n, 16, 6)
    _, stats = run_and_compare(engine, program, dtype, x, w, b, params)
    pre = (torch.nn.functional.linear(x, w, b) * params[0]).float()
    if dtype == torch.float32:
        var, mean = torch.var_mean(pre, dim=0, correction=1)
        torch.testing.assert_close(stats, torch.stack([mean, var]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,n", [(torch.float32, 128), (torch.bfloat16, 256)])
def test_batch_norm_statistics_with_an_empty_strip_and_idle_lanes(engine, dtype, n):
    """97 rows of one warp-wide segment on the emulator's four SMs: twelve strips of nine
    consecutive rows, the eleventh seven (its eighth lane has no row) and the twelfth none; the
    combine merges what the strips hold and nothing of the empty one."""
    program = PROGRAMS["s07_vec_batch_train"]
    x, w, b, params = inputs(program, dtype, 97, n, 16, 7)
    _, stats = run_and_compare(engine, program, dtype, x, w, b, params)
    if dtype == torch.float32:
        pre = torch.nn.functional.linear(x, w, b) * params[0]
        var, mean = torch.var_mean(pre, dim=0, correction=1)
        torch.testing.assert_close(stats, torch.stack([mean, var]), rtol=1e-5, atol=1e-5)


def test_batch_norm_statistics_of_values_far_from_zero_keep_their_variance(engine):
    """Columns of mean 1000 and variance about 1 (float32): the statistics sum deviations from a
    value of the column, so the variance keeps float32's precision of the deviations, where
    E[x^2] - E[x]^2 would lose it to cancellation (an error near 1000^2 * 2^-24, 0.06)."""
    program = PROGRAMS["s07_vec_batch_train"]
    x, w, b, params = inputs(program, torch.float32, 300, 64, 16, 8)
    params[0] = torch.ones_like(params[0])
    b = b + 1000.0
    stats = engine.forward_kernels(program.to_string(), x, w, b, params)[1]
    var, mean = torch.var_mean(torch.nn.functional.linear(x.double(), w.double(), b.double()), dim=0, correction=1)
    torch.testing.assert_close(stats[1].double(), var, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(stats[0].double(), mean, rtol=1e-6, atol=0)


def test_params_in_other_dtypes_and_shapes(engine):
    """Pointwise parameters in bfloat16 or float64, shaped (1, N) or (1,): read as p.float()."""
    program = PROGRAMS["s17_vec_hardtanh_mish_group"]
    x, w, b, params = inputs(program, torch.float32, 9, 48, 8, 5)
    params = [params[0].to(torch.bfloat16).reshape(1, 48), params[1], params[2]]
    run_and_compare(engine, program, torch.float32, x, w, b, params)
    program = PROGRAMS["scalar_param_pow"]
    x, w, b, params = inputs(program, torch.float32, 9, 48, 8, 6)
    run_and_compare(engine, program, torch.float32, x, w, b, [params[0].double().reshape(1)])


# -- the generated backward of pointwise and row programs ----------------------------------------

# (M, N): odd widths take the scalar path; 2048 spreads a layer norm's row over several warps
GRAD_SHAPES = [(7, 1000), (1, 16), (33, 24), (4, 5), (70, 256), (5, 2048)]


def compare_backward(engine, program, dtype, y, g, params):
    """The backward kernel (it must run: no fallback) against the reference's autograd (its norms
    as CUDA's: float32 math between the dtype's roundings)."""
    got = engine.backward_kernel(program.to_string(), g, y, params)
    assert got is not None, "the backward kernel did not run"
    m = y.numel() // y.shape[-1]
    tol = TOL[dtype]
    with norms_as_on_cuda(dtype):
        want = reference.epilogue_backward(program, g, y, params)
    assert_backward_close(program, got, want, tol, col_atol=tol * m, scalar_atol=tol * y.numel())
    return got


@pytest.mark.parametrize("name,dtype,m,n", [pytest.param(*c, id=f"{c[0]}-{str(c[1])[6:]}-{c[2]}x{c[3]}")
                                              for c in grad_cases(GRAD_SHAPES)])
def test_backward_kernel_matches_reference(engine, name, dtype, m, n):
    program = PROGRAMS[name]
    for seed in range(2):
        g = torch.Generator().manual_seed(seed)
        y = (torch.randn(m, n, generator=g) * 2).to(dtype)
        grad = torch.randn(program.output_shape((m,), n), generator=g).to(program.output_dtype(dtype))
        params = make_params(program, n, dtype=dtype if name in LOW_PRECISION else torch.float32, generator=g)
        compare_backward(engine, program, dtype, y, grad, params)


def test_norm_backward_kernel_leaves_other_group_sizes_to_the_reference(engine):
    """Groups that are not whole 16-byte chunks: no kernel, and epilogue_backward is the reference."""
    program = PROGRAMS["s02_group_leaky_double"]
    g = torch.Generator().manual_seed(5)
    y, grad = torch.randn(6, 36, generator=g), torch.randn(6, 36, generator=g)
    params = make_params(program, 36, generator=g)
    assert engine.backward_kernel(program.to_string(), grad, y, params) is None
    got = engine.backward(program.to_string(), grad, y, params)
    want = reference.epilogue_backward(program, grad, y, params)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_norm_backward_kernel_nan_inf(engine):
    """A NaN or an infinity in a row of the GEMM output, or a NaN in the gradient, makes that row's
    (that group's) gradient NaN, as eager's; the other rows keep theirs. (An infinite gradient
    meets inf - inf in the norm's backward, where the formula's order decides between NaN and an
    infinity: not compared.)"""
    for name in ["s20_layer_silu", "s04_group_silu_vec_silu", "s21_rms_silu"]:
        program = PROGRAMS[name]
        g = torch.Generator().manual_seed(6)
        y, grad = torch.randn(6, 64, generator=g) * 3, torch.randn(6, 64, generator=g)
        y[0, 3], y[1, 5], y[2, 11], grad[3, 7] = math.nan, math.inf, -math.inf, math.nan
        compare_backward(engine, program, torch.float32, y, grad, make_params(program, 64, generator=g))


def test_eval_batch_norm_backward_kernel_nan_inf(engine):
    """An eval-mode BatchNorm's statistics are constants (its running statistics): a NaN or an
    infinity in the GEMM output or the gradient reaches that element's gradient and its column's
    weight and bias sums only, as eager's; a running variance of zero scales by 1 / sqrt(eps)."""
    for name in ["s22_batch_eval_relu", "vec_batch_eval_silu_scalar"]:
        program = PROGRAMS[name]
        g = torch.Generator().manual_seed(8)
        y, grad = torch.randn(6, 64, generator=g) * 3, torch.randn(6, 64, generator=g)
        y[0, 3], y[1, 5], y[2, 11], grad[3, 7] = math.nan, math.inf, -math.inf, math.nan
        params = make_params(program, 64, generator=g)
        norm = next(s for s in program.stages if isinstance(s, Norm))
        params[norm.running_var][9] = 0.0
        got = compare_backward(engine, program, torch.float32, y, grad, params)
        assert got[0][4:, :3].isfinite().all() and got[0][0, 4:].isfinite().all()



def test_normalize_backward_kernel_on_rows_under_eps(engine):
    """F.normalize(eps=1e-3) on rows of zeros, rows whose norm is under eps (divided by eps: no
    gradient through the norm) and rows around it: the gradients are eager's."""
    program = PROGRAMS["normalize_large_eps"]
    g = torch.Generator().manual_seed(8)
    y = torch.randn(8, 48, generator=g)
    y[0] = 0.0
    y[1:4] *= torch.tensor([1e-5, 1e-4, 2e-4]).unsqueeze(1)  # norms around 1e-3
    compare_backward(engine, program, torch.float32, y, torch.randn(8, 48, generator=g), [])


@pytest.mark.parametrize("name", ZERO_ROW_NORMS)
def test_rows_of_zeros_take_eagers_gradient_whatever_reaches_the_norm(engine, name):
    """A row of zeros: eager's norm backward masks the row by a product (a finite gradient gives 0,
    an infinite or NaN one NaN — and F.normalize at eps 0 sends it NaN), std's by a fill (0
    always)."""
    program = PROGRAMS[name]
    y, grad, params = rows_of_zeros(program)
    compare_backward(engine, program, torch.float32, y, grad, params)


@pytest.mark.parametrize("name", REDUCTION_EDGES)
def test_reduction_backward_kernel_at_ties_nan_and_inf(engine, name):
    """Rows of small integers, where max and min tie (amax/amin split the gradient over the tied
    elements, max(dim)/min(dim) give it to the first), and rows holding NaN, +inf, -inf, only
    -inf or only zeros: the gradients are eager's, NaN where eager's are."""
    program = PROGRAMS[name]
    y, grad, params = reduction_edges(program)
    compare_backward(engine, program, torch.float32, y, grad, params)


def test_backward_kernel_is_eager_to_the_bit_where_each_gradient_op_is_exact(engine):
    """bf16(relu(bf16(bf16(x - 2) * 1.5))), as Dynamo traces S13 in bfloat16: eager rounds after
    the mask and the product, the kernel once at the store -- the same single rounding of g * 1.5."""
    def bf16(e):
        return call("bf16", e)

    program = Program(Gemm(True), (pw(bf16(call("relu", bf16(E.mul(bf16(E.sub(E.X, E.const(2.0))), E.const(1.5)))))),))
    g = torch.Generator().manual_seed(0)
    y = (torch.randn(64, 256, generator=g) * 3).to(torch.bfloat16)
    grad = torch.randn(64, 256, generator=g).to(torch.bfloat16)
    dy, _ = engine.backward_kernel(program.to_string(), grad, y, [])
    assert torch.equal(dy, reference.epilogue_backward(program, grad, y, [])[0])


def test_backward_kernel_layouts(engine):
    """A 3-D output, an expanded gradient (a sum's backward), a misaligned GEMM output."""
    program = PROGRAMS["s14_silu_div_clamp_tanh"]
    g = torch.Generator().manual_seed(3)
    y3 = torch.randn(2, 5, 64, generator=g)
    compare_backward(engine, program, torch.float32, y3, torch.randn(2, 5, 64, generator=g), [])
    compare_backward(engine, program, torch.float32, y3, torch.randn(1, 1, 64, generator=g).expand(2, 5, 64), [])
    storage = torch.randn(10 * 64 + 1, generator=g)
    compare_backward(engine, program, torch.float32, storage[1:].view(10, 64), torch.randn(10, 64, generator=g), [])


def test_backward_kernel_nan_inf(engine):
    """NaN and infinities in the GEMM output and the gradient propagate as in eager."""
    for name in ["vocabulary_1", "vocabulary_2", "s01_scale_leaky", "powers"]:
        program = PROGRAMS[name]
        g = torch.Generator().manual_seed(4)
        y = torch.randn(6, 40, generator=g) * 3
        grad = torch.randn(6, 40, generator=g)
        y[0, :4] = torch.tensor([math.nan, math.inf, -math.inf, 0.0])
        grad[1, :3] = torch.tensor([math.nan, math.inf, -math.inf])
        compare_backward(engine, program, torch.float32, y, grad, make_params(program, 40, generator=g))
