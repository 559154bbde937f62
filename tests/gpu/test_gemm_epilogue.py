"""The in-GEMM back end (csrc/gemm_epilogue.cuh, fxfuse/cuda/gemm_codegen.py) on a Hopper GPU.

Pointwise and row-reduction programs, LayerNorms, RMSNorms and softmaxes (per (row, subtile)
statistics in the epilogue, then a pass mapping the rows in place), eval-mode batch norms
(pointwise per column with the running statistics: 2-D x only, as torch takes dim 1 of a 3-D value
as channels) (bf16, fp16, and float32 as TF32 while torch allows TF32) compute under the
correctness rule, each kernel of the production menu on a program of each kind (EVERY_KERNEL) and
each program on a kernel or two of the menu in turn: within 1e-2 of eager's result, or no further
from the float64 truth than eager's own result (the epilogue computes in float32 on the
accumulators and rounds once, where eager rounds the GEMM output and every op). Every element is
written (outputs poisoned with NaN first), NaN and Inf reach the same positions as eager's, odd
shapes run, and the selection routes a shape to a measured path that covers it.
"""

from __future__ import annotations

import math

import pytest
import torch

import fxfuse.cuda as fxcuda
from fxfuse import expr as E
from fxfuse import reference
from fxfuse.cuda.gemm_codegen import FEW_ROWS_KERNELS, KERNELS, Kernel, unsupported_reason
from fxfuse.ir import Gemm, Pointwise, Program, Reduce
from fxfuse.vocabulary import call
from gemm_harness import (DEVICE, SCHEDULES, TOL, Modules, assert_every_kernel_computes, assert_under_rule, build_modules,
                          draw, every_schedule, kernels, names_of, on_checking_menus, run_config, truth)
from programs import PROGRAMS, vocabulary_program

X = E.X

EXTRA = {
    "scalar_and_col": Program(Gemm(True), (Pointwise(call("silu", E.add(E.mul(X, E.param(0)), E.param(1)))),),
                              ("scalar", "col")),
    "widen_vec_relu": PROGRAMS["widen_s09_vec_relu"],
    "softmax": Program(Gemm(True), (Reduce("softmax"),)),
    "vocabulary_a": vocabulary_program(["relu", "leaky_relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh"]),
    "vocabulary_b": vocabulary_program(["mish", "clamp", "hardtanh", "hardswish", "hardsigmoid", "elu", "selu",
                                        "softplus", "abs", "maximum"]),
    # operands of the output's shape beside column and scalar ones: gelu(x + residual) * gate * v * s
    "full_two_and_col": Program(Gemm(True), (Pointwise(E.mul(E.mul(E.mul(call("gelu", E.add(X, E.param(0))),
                                                                         E.param(1)), E.param(2)), E.param(3))),),
                                ("full", "full", "col", "scalar")),
}
# norms and softmaxes over the row: (row, subtile) partials in the epilogue, then a pass a row
ROW_MAPS = ["s20_layer_silu", "s21_rms_silu", "full_residual_layer", "rms_no_weight", "s11_gelu_softmax",
            "log_softmax_then_pointwise", "normalize_then_col", "normalize_no_eps"]
REDUCTIONS = ["s05_logsumexp_chain", "s15_div_sum_mul", "s16_sigmoid_sum", "reduce_max_keep", "reduce_min_drop",
              "reduce_mean_drop", "reduce_vector_norm_keep"]  # one value a row: partials in the epilogue, then a finalize
NAMES = ["identity", "s01_scale_leaky", "s10_div_gelu", "s13_sub_mul_relu", "s14_silu_div_clamp_tanh",
         "full_residual", "full_gate_silu", "gemm_gate_silu", "gemm_up_first_silu", "gemm_gate_gelu_scaled",
         "s22_batch_eval_relu", "vec_batch_eval_silu_scalar", *REDUCTIONS, *ROW_MAPS, *EXTRA]
CASES = [(name, torch.bfloat16) for name in NAMES] + [("s01_scale_leaky", torch.float16),
                                                      ("scalar_and_col", torch.float16),
                                                      ("full_gate_silu", torch.float16),
                                                      ("gemm_gate_silu", torch.float16),
                                                      ("s20_layer_silu", torch.float16),
                                                      ("s01_scale_leaky", torch.float32),  # TF32
                                                      ("s21_rms_silu", torch.float32),
                                                      ("s15_div_sum_mul", torch.float32)]
SHAPES = [(1, 136, 72), (7, 520, 264), (300, 1032, 520), (1024, 2048, 512)]


def program_of(name: str) -> Program:
    return EXTRA.get(name) or PROGRAMS[name]


# The modules on the production menu, each kernel of it checked: a pointwise program of each
# operand kind (scalar and column; of the output's shape), the gated pair, a row reduction, a
# LayerNorm's and a softmax's partials, TF32, and those the selection's tests route. The others
# carry a kernel or two in turn (gemm_harness.checking_menu).
EVERY_KERNEL = {("s01_scale_leaky", torch.bfloat16), ("s01_scale_leaky", torch.float32), ("s10_div_gelu", torch.bfloat16),
                ("s13_sub_mul_relu", torch.bfloat16), ("scalar_and_col", torch.bfloat16),
                ("full_two_and_col", torch.bfloat16), ("gemm_gate_silu", torch.bfloat16),
                ("s05_logsumexp_chain", torch.bfloat16), ("s20_layer_silu", torch.bfloat16),
                ("s11_gelu_softmax", torch.bfloat16)}
BUILDS = on_checking_menus({(name, dtype): (program_of(name), dtype) for name, dtype in CASES},
                           EVERY_KERNEL)  # also built by prebuild.py


@pytest.fixture(autouse=True)
def tf32():
    """The float32 cases are TF32 GEMMs: run while torch allows TF32 (as its own matmuls then are,
    eager's included), over the tests' default of TF32 off (tests/conftest.py restores it)."""
    torch.backends.cuda.matmul.allow_tf32 = True


@pytest.fixture(scope="module")
def hopper():
    """Skips without a Hopper GPU, nvcc or CUTLASS (tests that build their own modules)."""
    build_modules({})


@pytest.fixture(scope="module")
def modules(request):
    return Modules(request, BUILDS)


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("name,dtype", CASES)
def test_every_configuration_computes_the_program(modules, name, dtype, m, n, k):
    assert_every_kernel_computes(modules[(name, dtype)], program_of(name), dtype, m, n, k,
                                 seeds=5 if m * n < 1 << 20 else 1)


@pytest.mark.parametrize("name", ["scalar_and_col", "s05_logsumexp_chain"])
def test_every_schedule_of_every_kernel(modules, name):
    """Schedules reorder tiles, and a swizzle pads the tile grid past M and N with tiles of nothing:
    no output, and no row's partials, comes from them."""
    program, module = program_of(name), modules[(name, torch.bfloat16)]
    x, w, b, params = draw(program, torch.bfloat16, 700, 2056, 264, seed=8)
    eager = reference.op_forward(program, x, w, b, params, False)[0]
    exact = truth(program, x, w, b, params)
    for config in every_schedule(module, 700, 2056, 264):
        assert_under_rule(run_config(module, program, x, w, b, params, config), eager, exact)


@pytest.mark.parametrize("name,dtype", [("s01_scale_leaky", torch.bfloat16), ("scalar_and_col", torch.float16),
                                        ("full_two_and_col", torch.bfloat16), ("gemm_gate_gelu_scaled", torch.bfloat16),
                                        ("full_residual_layer", torch.bfloat16)])  # BERT's block: (B, T, N)
def test_three_dimensional_input(modules, name, dtype):
    program, module = program_of(name), modules[(name, dtype)]
    x, w, b, params = draw(program, dtype, 37, 264, 136, seed=3, batch=(3,))
    eager = reference.op_forward(program, x, w, b, params, False)[0]
    out = run_config(module, program, x, w, b, params, 0)
    assert out.shape == (3, 37, 264)
    assert_under_rule(out, eager, truth(program, x, w, b, params))


def test_a_three_dimensional_input_of_a_batch_norm_is_not_the_modules(modules):
    """torch's batch norm takes dim 1 of a 3-D value as its channels, not the GEMM's features: the
    module covers 2-D x only (as the row kernels), and the call computes what eager computes (here
    eager's error: 37 channels against running statistics of 264)."""
    program, module = program_of("s22_batch_eval_relu"), modules[("s22_batch_eval_relu", torch.bfloat16)]
    x, w, b, params = draw(program, torch.bfloat16, 37, 264, 136, seed=3, batch=(3,))
    assert fxcuda.engine.forward_kernels(program.to_string(), x, w, b, params, gemm=module, config=0) is None
    with pytest.raises(RuntimeError):
        fxcuda.engine.call(program.to_string(), x, w, b, params, gemm=module, config=0)


@pytest.mark.parametrize("name", ["s05_logsumexp_chain", "reduce_min_drop"])
def test_a_reduced_three_dimensional_input_keeps_its_leading_dims(modules, name):
    program, module = program_of(name), modules[(name, torch.bfloat16)]
    x, w, b, params = draw(program, torch.bfloat16, 37, 264, 136, seed=3, batch=(3,))
    eager = reference.op_forward(program, x, w, b, params, False)[0]
    out = run_config(module, program, x, w, b, params, 0)
    assert out.shape == eager.shape and eager.shape[:2] == (3, 37) and eager.numel() == 3 * 37
    assert_under_rule(out, eager, truth(program, x, w, b, params))


def assert_every_kernel_puts_nan_and_inf_where_eager_does(module, program, x, w, b, params) -> None:
    eager = reference.op_forward(program, x, w, b, params, False)[0]
    for config in kernels(module):
        out = run_config(module, program, x, w, b, params, config)
        assert torch.equal(out.isnan(), eager.isnan())
        assert torch.equal(out.isposinf(), eager.isposinf()) and torch.equal(out.isneginf(), eager.isneginf())


@pytest.mark.parametrize("name", ["s01_scale_leaky", "s14_silu_div_clamp_tanh", "vocabulary_b"])
def test_nan_and_inf_reach_eagers_positions(modules, name):
    program, module = program_of(name), modules[(name, torch.bfloat16)]
    x, w, b, params = draw(program, torch.bfloat16, 64, 264, 72, seed=5)
    x[3, 5] = math.nan
    x[7, :] = math.inf
    x[9, 2] = -math.inf
    assert_every_kernel_puts_nan_and_inf_where_eager_does(module, program, x, w, b, params)


@pytest.mark.parametrize("name", ["s20_layer_silu", "s21_rms_silu"])
def test_a_row_norm_gives_nan_and_inf_where_eager_does(modules, name):
    """A NaN anywhere in a row makes its norm NaN; an infinity in every row (column 300, in the
    row's fifth subtile) makes a LayerNorm's rows NaN, and an RMSNorm's zero but there (its sum of
    squares is infinite: rsqrt of it 0, 0 times the infinity NaN), as eager's."""
    program, module = program_of(name), modules[(name, torch.bfloat16)]
    x, w, b, params = draw(program, torch.bfloat16, 64, 600, 72, seed=5)
    x[3, 5] = math.nan
    b[300] = -math.inf
    assert_every_kernel_puts_nan_and_inf_where_eager_does(module, program, x, w, b, params)


@pytest.mark.parametrize("name", ["softmax", "log_softmax_then_pointwise"])
def test_a_softmax_gives_nan_and_inf_where_eager_does(modules, name):
    """A NaN in a row, or +inf (column 10 where the row's x[:, 0] is positive), makes the row's
    softmax NaN; -inf (column 300 of every row, and column 10 of the other rows) is a 0 (-inf for
    log_softmax) beside the row's finite values, as eager's."""
    program, module = program_of(name), modules[(name, torch.bfloat16)]
    x, w, b, params = draw(program, torch.bfloat16, 64, 600, 72, seed=5)
    x[3, 5] = math.nan
    w[10, :] = 0.0
    w[10, 0] = math.inf
    b[300] = -math.inf
    assert_every_kernel_puts_nan_and_inf_where_eager_does(module, program, x, w, b, params)


@pytest.mark.parametrize("name", ["s05_logsumexp_chain", "reduce_max_keep", "reduce_min_drop", "s16_sigmoid_sum",
                                  "reduce_vector_norm_keep"])
def test_a_row_reduction_gives_nan_and_inf_where_eager_does(modules, name):
    """A NaN anywhere in a row makes its reduction NaN; +inf and -inf in a row (in different
    N-tiles) give eager's infinite or NaN sum, max, min and logsumexp."""
    program, module = program_of(name), modules[(name, torch.bfloat16)]
    x, w, b, params = draw(program, torch.bfloat16, 64, 600, 72, seed=5)
    x[3, 5] = math.nan
    w[10, :] = 0.0
    w[10, 0] = math.inf  # column 10: +inf or -inf, the sign of the row's x[:, 0]
    b[300] = -math.inf  # column 300: -inf in every row
    assert_every_kernel_puts_nan_and_inf_where_eager_does(module, program, x, w, b, params)


def test_nan_and_inf_in_an_operand_of_the_output_shape_reach_eagers_positions(modules):
    program, module = program_of("full_two_and_col"), modules[("full_two_and_col", torch.bfloat16)]
    x, w, b, params = draw(program, torch.bfloat16, 200, 264, 72, seed=7)
    params[0][3, 5] = math.nan
    params[0][7, :] = math.inf
    params[1][9, 2] = -math.inf
    params[1][11, 4] = 0.0
    params[0][11, 4] = math.inf  # gelu(inf) * 0: NaN
    assert_every_kernel_puts_nan_and_inf_where_eager_does(module, program, x, w, b, params)


def test_nan_and_inf_through_either_gemm_of_a_gated_pair_reach_eagers_positions(modules):
    program, module = program_of("gemm_gate_silu"), modules[("gemm_gate_silu", torch.bfloat16)]
    x, w, b, params = draw(program, torch.bfloat16, 200, 264, 72, seed=7)
    x[3, 5] = math.nan
    w[40, :] = math.inf  # the gate GEMM's column 40: silu(inf) * up
    params[0][41, :] = -math.inf  # the second GEMM's column 41: silu(gate) * -inf
    params[0][42, 0] = math.nan
    assert_every_kernel_puts_nan_and_inf_where_eager_does(module, program, x, w, b, params)


def test_a_gated_pair_reads_its_weights_as_they_are_now(modules):
    """The gated kernel runs over an interleaved copy of its two weights, built once per pair:
    after an in-place update of either weight (an optimizer step) it computes with the new values."""
    program, module = program_of("gemm_gate_silu"), modules[("gemm_gate_silu", torch.bfloat16)]
    x, w, b, params = draw(program, torch.bfloat16, 96, 264, 136, seed=12)
    for step in range(3):
        eager = reference.op_forward(program, x, w, b, params, False)[0]
        exact = truth(program, x, w, b, params)
        for config in kernels(module):
            assert_under_rule(run_config(module, program, x, w, b, params, config), eager, exact)
        with torch.no_grad():
            (w if step % 2 == 0 else params[0]).mul_(-1.5)


def test_a_gated_pair_interleaves_its_weights_once_even_through_aliases(modules):
    """A compiled graph may hand the op aliases of the parameters (detached views of the same
    storage): the same weights, so the interleaved copy is made once, not on every call."""
    program, module = program_of("gemm_gate_silu"), modules[("gemm_gate_silu", torch.bfloat16)]
    x, w, b, params = draw(program, torch.bfloat16, 64, 264, 136, seed=13)
    gated = next(c for c, name in enumerate(module.config_names) if name.startswith("gated"))
    first = run_config(module, program, x, w, b, params, gated)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(3):
            again = run_config(module, program, x, w.detach(), b, [params[0].detach()], gated)
        torch.cuda.synchronize()
    kernels_run = [event.name for event in profile.events() if event.device_type == torch.autograd.DeviceType.CUDA]
    assert not [name for name in kernels_run if "at::native" in name and "copy" in name], kernels_run
    assert torch.equal(again, first)


def test_an_operand_view_off_16_byte_alignment_is_read_from_an_aligned_copy(modules):
    """TMA needs a 16-byte aligned base: a residual sliced one element in is copied first."""
    program, module = program_of("full_residual"), modules[("full_residual", torch.bfloat16)]
    x, w, b, _ = draw(program, torch.bfloat16, 96, 520, 136, seed=9)
    residual = torch.randn(96 * 520 + 1, device=DEVICE, dtype=torch.bfloat16)[1:].view(96, 520)
    assert residual.data_ptr() % 16 != 0
    eager = reference.op_forward(program, x, w, b, [residual], False)[0]
    exact = truth(program, x, w, b, [residual])
    for config in kernels(module):
        assert_under_rule(run_config(module, program, x, w, b, [residual], config), eager, exact)


def test_unaligned_shapes_take_the_row_path(modules):
    """K not a multiple of 8 (rows of x not 16-byte aligned): no configuration covers it, the
    selection measures only the row path and the call still equals the reference."""
    program, module = program_of("s01_scale_leaky"), modules[("s01_scale_leaky", torch.bfloat16)]
    assert not any(module.supports(64, 256, 100, c) for c in range(len(module.config_names)))
    selection = fxcuda.select(program, torch.bfloat16, (), (64, 256, 100), True)
    assert selection.config == -1 and list(selection.times_us) == ["row"]
    x, w, b, params = draw(program, torch.bfloat16, 64, 256, 100, seed=1)
    out = torch.ops.fxfuse.linear_epilogue(program.to_string(), x, w, b, params, False)[0]
    torch.testing.assert_close(out, reference.op_forward(program, x, w, b, params, False)[0], atol=TOL, rtol=TOL)


def test_selection_routes_the_bucket_to_the_fastest_measured_path(modules):
    program = program_of("s10_div_gelu")
    selection = fxcuda.select(program, torch.bfloat16, (), (1024, 2048, 512), True)
    module = modules[("s10_div_gelu", torch.bfloat16)]
    # every configuration of the kernels for many rows; the swapped ones, for few rows, are not timed
    assert set(selection.times_us) == {"row", *names_of(module, KERNELS)}
    assert names_of(module, FEW_ROWS_KERNELS)
    # the screen's fastest, or where an in-GEMM configuration won it, the faster of it and the row
    # path each timed alone again (Selection.final_us)
    decided = selection.final_us or selection.times_us
    if selection.final_us:
        assert set(decided) == {"row", min(selection.times_us, key=selection.times_us.get)}
    assert decided[selection.path] == min(decided.values())
    x, w, b, params = draw(program, torch.bfloat16, 1000, 2048, 512, seed=2)  # same bucket of M
    out = torch.ops.fxfuse.linear_epilogue(program.to_string(), x, w, b, params, False)[0]
    eager = reference.op_forward(program, x, w, b, params, False)[0]
    assert_under_rule(out, eager, truth(program, x, w, b, params))


def test_a_call_in_a_bucket_no_selection_timed_is_timed_on_its_first_call_then_routed(modules, monkeypatch):
    """A graph with a symbolic batch serves every size: the first call in a bucket of M that no
    selection timed is timed on its own operands (the row path and the configurations of the
    module as held), its bucket routed, and its output computes the program; the bucket's later
    calls take that route without timing."""
    import sys

    engine_module = sys.modules["fxfuse.cuda.engine"]
    program, module = program_of("s10_div_gelu"), modules[("s10_div_gelu", torch.bfloat16)]
    monkeypatch.setattr(engine_module, "read_measurement", lambda path, kind: None)  # measured here, now
    monkeypatch.setattr(engine_module, "write_measurement", lambda path, measurement: None)
    monkeypatch.setattr(fxcuda.engine, "selections", {})
    x, w, b, params = draw(program, torch.bfloat16, 3000, 2048, 512, seed=3)  # bucket 12, timed by no test
    out = torch.ops.fxfuse.linear_epilogue(program.to_string(), x, w, b, params, False)[0]
    (skey, selection), = fxcuda.engine.selections.items()
    assert skey[2:5] == (2048, 512, 12)
    assert set(selection.times_us) == {"row", *names_of(module, KERNELS)}
    eager = reference.op_forward(program, x, w, b, params, False)[0]
    assert_under_rule(out, eager, truth(program, x, w, b, params))
    fxcuda.engine.selections.clear()
    again = torch.ops.fxfuse.linear_epilogue(program.to_string(), x, w, b, params, False)[0]
    assert not fxcuda.engine.selections  # routed: not timed again
    assert_under_rule(again, eager, truth(program, x, w, b, params))


def test_a_configuration_whose_output_is_wrong_is_never_timed_or_chosen(modules, monkeypatch):
    """The selection runs each configuration once beside the row pass before timing it: here the
    module's first kernel is made to return a wrong output (as a kernel fault would) under all its
    tile orders; none of them is timed, a warning names them, and the calls take a correct path."""
    import sys

    engine_module = sys.modules["fxfuse.cuda.engine"]
    program, module = program_of("s13_sub_mul_relu"), modules[("s13_sub_mul_relu", torch.bfloat16)]
    runtime = fxcuda.engine._runtime_module
    real_run = runtime.run

    def faulty_run(handle, x, w, b, params, flags, save_gemm, gemm, config):
        result = real_run(handle, x, w, b, params, flags, save_gemm, gemm, config)
        return (result[0] + 1.0, *result[1:]) if 0 <= config < SCHEDULES else result

    monkeypatch.setattr(runtime, "run", faulty_run)
    monkeypatch.setattr(engine_module, "read_measurement", lambda path, kind: None)  # measured here, now
    monkeypatch.setattr(engine_module, "write_measurement", lambda path, measurement: None)
    monkeypatch.setattr(fxcuda.engine, "selections", {})
    with pytest.warns(RuntimeWarning, match=f"{SCHEDULES} in-GEMM configurations .* disagree with the row pass"):
        selection = fxcuda.select(program, torch.bfloat16, (), (512, 1032, 264), True)
    assert set(selection.times_us) == {"row", *names_of(module, KERNELS, range(SCHEDULES, len(module.config_names)))}
    monkeypatch.setattr(runtime, "run", real_run)
    x, w, b, params = draw(program, torch.bfloat16, 512, 1032, 264, seed=6)
    out = torch.ops.fxfuse.linear_epilogue(program.to_string(), x, w, b, params, False)[0]
    eager = reference.op_forward(program, x, w, b, params, False)[0]
    assert_under_rule(out, eager, truth(program, x, w, b, params))


def test_a_call_that_saves_the_gemm_output_takes_the_row_path(modules):
    """Training keeps the GEMM output for the backward: the in-GEMM kernel does not write it."""
    program, module = program_of("s01_scale_leaky"), modules[("s01_scale_leaky", torch.bfloat16)]
    x, w, b, params = draw(program, torch.bfloat16, 64, 264, 72, seed=4)
    out, _, gemm, _ = fxcuda.engine.call(program.to_string(), x, w, b, params, save_gemm=True, gemm=module, config=0)
    torch.testing.assert_close(gemm, reference.gemm(x, w, b))
    torch.testing.assert_close(out, reference.op_forward(program, x, w, b, params, False)[0], atol=0, rtol=0)


def test_cuda_graph_replay(modules):
    """A captured in-GEMM call writes its whole output on every replay."""
    program, module = program_of("scalar_and_col"), modules[("scalar_and_col", torch.bfloat16)]
    x, w, b, params = draw(program, torch.bfloat16, 256, 1032, 264, seed=6)
    eager = reference.op_forward(program, x, w, b, params, False)[0]
    exact = truth(program, x, w, b, params)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        run_config(module, program, x, w, b, params, 1)  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run_config(module, program, x, w, b, params, 1)  # in the graph's memory pool
    out.fill_(math.nan)  # the replay writes every element again
    graph.replay()
    torch.cuda.synchronize()
    assert_under_rule(out, eager, exact)


def test_a_compiled_residual_block_measures_the_in_gemm_path_and_equals_eager(modules):
    """x + proj(h) under policy "always": the chain reads its residual in the GEMM's epilogue or in
    the row pass, whichever measured faster at the shape; the report names the times of both."""
    import fxfuse

    class Residual(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(512, 1024)

        def forward(self, h, x):
            return x + self.proj(h)

    torch.manual_seed(0)
    model = Residual().to(DEVICE, torch.bfloat16)
    h = torch.randn(4, 64, 512, device=DEVICE, dtype=torch.bfloat16)
    x = torch.randn(4, 64, 1024, device=DEVICE, dtype=torch.bfloat16)
    fxfuse.reset_report()
    compiled = torch.compile(model, backend="fxfuse", options={"policy": "always"})
    with torch.no_grad():
        out, eager = compiled(h, x), model(h, x)
        exact = x.double() + torch.nn.functional.linear(h.double(), model.proj.weight.double(),
                                                        model.proj.bias.double())
    (row,) = fxfuse.last_report().rows
    assert row.status == "fused" and "measured (" in row.path and "row " in row.path
    assert "cooperative" in row.path  # the in-GEMM configurations were candidates
    assert_under_rule(out, eager, exact)


class ScaledLeaky(torch.nn.Module):
    """leaky_relu(linear(x) * scale, slope) from 512 features: S01's chain in a model of its own."""

    def __init__(self, features: int, scale: float, slope: float):
        super().__init__()
        self.linear = torch.nn.Linear(512, features)
        self.scale, self.slope = scale, slope

    def forward(self, x):
        return torch.nn.functional.leaky_relu(self.linear(x) * self.scale, self.slope)


def _kernels_launched(call) -> list[str]:
    """The names of the CUDA kernels one call launches, in order, a GEMM module's namespace
    (``fxg_`` and 20 characters of its key: build.build_gemm) left out of them."""
    import re

    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return [re.sub(r"fxg_\w{20}", "fxg_", event.name) for event in prof.events()
            if event.device_type == torch.autograd.DeviceType.CUDA]


def test_a_module_built_for_few_rows_grows_for_many_and_keeps_the_few_rows_route(hopper):
    """A chain compiled for 16 rows gets a module with the kernel for up to 16 rows alone; compiled
    again for 1024 rows, the module is built again with the kernels for many rows too and takes the
    first one's place. The 16-row calls then launch the kernels the selection chose for them
    before, and every call obeys the rule."""
    import fxfuse

    def exact(x):
        return torch.nn.functional.leaky_relu(torch.nn.functional.linear(
            x.double(), model.linear.weight.double(), model.linear.bias.double()) * 1.5, 0.05)

    torch.manual_seed(2)  # constants of no other test's program: its module is this test's own
    model = ScaledLeaky(2048, 1.5, 0.05).to(DEVICE, torch.bfloat16)
    few = torch.randn(16, 512, device=DEVICE, dtype=torch.bfloat16)
    many = torch.randn(1024, 512, device=DEVICE, dtype=torch.bfloat16)
    compiled = torch.compile(model, backend="fxfuse", dynamic=False, options={"policy": "always"})
    held = set(fxcuda.engine._gemms)
    with torch.no_grad():
        assert_under_rule(compiled(few), model(few), exact(few))
        (gkey,) = set(fxcuda.engine._gemms) - held
        assert fxcuda.engine._gemms[gkey].kernels == FEW_ROWS_KERNELS[:1]  # the 16-wide tile
        before = _kernels_launched(lambda: compiled(few))
        fxfuse.reset_report()
        assert_under_rule(compiled(many), model(many), exact(many))
        assert fxfuse.last_report().rows[0].status == "fused"
        assert fxcuda.engine._gemms[gkey].kernels == KERNELS + FEW_ROWS_KERNELS[:1]
        assert _kernels_launched(lambda: compiled(few)) == before
        assert_under_rule(compiled(few), model(few), exact(few))


def test_by_default_the_selection_times_inductors_kernels_and_the_faster_runs(hopper):
    """The default policy: at the chain's shape the selection times Inductor's own kernels for the
    chain beside fxfuse's paths; the chain stays fused only where one of fxfuse's paths won, and
    the report says which and the times either way."""
    import fxfuse

    class Gate(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(512, 2048, bias=False)

        def forward(self, h, up):
            return torch.nn.functional.silu(self.proj(h)) * up

    torch.manual_seed(1)
    model = Gate().to(DEVICE, torch.bfloat16)
    h = torch.randn(1024, 512, device=DEVICE, dtype=torch.bfloat16)
    up = torch.randn(1024, 2048, device=DEVICE, dtype=torch.bfloat16)
    fxfuse.reset_report()
    with torch.no_grad():
        out, eager = torch.compile(model, backend="fxfuse")(h, up), model(h, up)
        exact = torch.nn.functional.silu(h.double() @ model.proj.weight.double().t()) * up.double()
    (row,) = fxfuse.last_report().rows
    if row.status == "fused":
        assert "Inductor " in row.path and "measured (" in row.path
    else:
        assert "than Inductor at this shape" in row.reason or "Inductor is faster at this shape" in row.reason
        assert "Inductor " in row.reason
    assert_under_rule(out, eager, exact)


# a program of each kind of kernel after the GEMM: none, a row reduction's finalize, a row map's
# pass, a training BatchNorm's finalize and normalize
PDL = ["s01_scale_leaky", "s05_logsumexp_chain", "s21_rms_silu", "s07_vec_batch_train"]
PDL_MENU = (Kernel(256, 128, cluster_m=2, pdl=True),)
PDL_BUILDS = {name: (PROGRAMS[name], torch.bfloat16, PDL_MENU) for name in PDL}  # also built by prebuild.py


@pytest.fixture(scope="module")
def pdl_modules():
    return build_modules(PDL_BUILDS)


@pytest.mark.parametrize("name", PDL)
def test_kernels_launched_as_programmatic_dependents_compute_the_program_back_to_back(pdl_modules, name):
    """A GEMM that may start while the kernel before it drains, and kernels after it that may start
    while its last tiles run, each wait for what they read: three calls captured back to back in
    one CUDA graph (each on its own inputs; a call's workspace may be the one the call before it
    freed) give every call's output, and a training BatchNorm's batch statistics, under the rule.
    (A kernel for gemm_configs.py's measurements; not in the production menu.)"""
    from gemm_harness import run_config_outputs, truth_statistics

    program, module = PROGRAMS[name], pdl_modules[name]
    draws = [draw(program, torch.bfloat16, 300, 1032, 520, seed=20 + i) for i in range(3)]
    for config in range(len(module.config_names)):  # every tile order
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            run_config_outputs(module, program, *draws[0], config)  # warm up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            results = [run_config_outputs(module, program, *values, config) for values in draws]
        for result in results:
            for tensor in result[:2]:
                if tensor is not None:
                    tensor.fill_(math.nan)  # the replay writes every element again
        graph.replay()
        torch.cuda.synchronize()
        for (x, w, b, values), result in zip(draws, results):
            eager = reference.op_forward(program, x, w, b, values, False)
            assert_under_rule(result[0], eager[0], truth(program, x, w, b, values))
            if program.batch_norm_training is not None:  # its batch statistics
                stats = truth_statistics(program, x, w, b, values)
                assert_under_rule(result[1], eager[1], stats.to(result[1].dtype))


def test_a_weight_read_transposed_is_timed_as_the_calls_read_it(hopper):
    """GPT-2's Conv1D keeps its weight (K, N): the GEMM configurations read an (N, K) weight, so the
    selection times the row path (cuBLAS reads either layout) against Inductor, with that layout."""
    program = program_of("full_residual")
    selection = fxcuda.select(program, torch.bfloat16, (torch.bfloat16,), (512, 1032, 520), True, ((512, 1032),),
                              against_inductor=True, weight_is_kn=True)
    assert selection.config == -1 and set(selection.times_us) == {"row", "Inductor"}
    x, w, b, params = draw(program, torch.bfloat16, 512, 1032, 520, seed=10)
    w_kn = w.t().contiguous()
    out = torch.ops.fxfuse.linear_epilogue(program.to_string(), x, w_kn.t(), b, params, False)[0]
    assert_under_rule(out, reference.op_forward(program, x, w, b, params, False)[0], truth(program, x, w, b, params))


def test_a_float32_gemm_takes_the_row_path_when_torch_does_not_allow_tf32(modules):
    """The module computes in TF32; with TF32 off a call runs cuBLAS's float32 GEMM and the row pass."""
    program, module = program_of("s01_scale_leaky"), modules[("s01_scale_leaky", torch.float32)]
    x, w, b, params = draw(program, torch.float32, 64, 264, 72, seed=4)
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        result = fxcuda.engine.forward_kernels(program.to_string(), x, w, b, params, gemm=module, config=0)
        eager = reference.op_forward(program, x, w, b, params, False)[0]
        assert unsupported_reason(program, torch.float32) is not None
    finally:
        torch.backends.cuda.matmul.allow_tf32 = True
    torch.testing.assert_close(result[0], eager, rtol=1e-4, atol=1e-4)


def test_supported_programs_are_the_pointwise_norm_and_row_reduction_ones():
    assert unsupported_reason(PROGRAMS["s01_scale_leaky"], torch.bfloat16) is None
    assert unsupported_reason(PROGRAMS["s01_scale_leaky"], torch.float32) is None  # TF32, allowed here
    assert unsupported_reason(PROGRAMS["s01_scale_leaky"], torch.float64) is not None
    assert unsupported_reason(PROGRAMS["s02_group_leaky_double"], torch.bfloat16) is None
    assert unsupported_reason(PROGRAMS["s15_div_sum_mul"], torch.bfloat16) is None
    assert unsupported_reason(PROGRAMS["s20_layer_silu"], torch.bfloat16) is None
    assert unsupported_reason(PROGRAMS["s21_rms_silu"], torch.bfloat16) is None
    assert unsupported_reason(PROGRAMS["s11_gelu_softmax"], torch.bfloat16) is None
    assert unsupported_reason(PROGRAMS["normalize_then_col"], torch.bfloat16) is None
    assert unsupported_reason(PROGRAMS["reduce_var_keep"], torch.bfloat16) is not None


def test_a_compiled_model_reports_its_measured_path_and_equals_eager(modules):
    """torch.compile(backend="fxfuse"), the default policy: the chain is measured at its shape
    against Inductor, the report names the path taken and every path's time, and the output obeys
    the rule."""
    import fxfuse

    torch.manual_seed(0)
    model = ScaledLeaky(1024, 2.0, 0.1).to(DEVICE, torch.bfloat16)
    x = torch.randn(4, 64, 512, device=DEVICE, dtype=torch.bfloat16)
    fxfuse.reset_report()
    compiled = torch.compile(model, backend="fxfuse")
    with torch.no_grad():
        out, eager = compiled(x), model(x)
        exact = torch.nn.functional.leaky_relu(
            torch.nn.functional.linear(x.double(), model.linear.weight.double(), model.linear.bias.double()) * 2.0, 0.1)
    (row,) = fxfuse.last_report().rows
    # at this small shape either side may win; the report names every path's time either way
    said = row.path if row.status == "fused" else row.reason
    assert "measured (" in said and "row " in said and "cooperative" in said and "Inductor " in said
    assert_under_rule(out, eager, exact)
