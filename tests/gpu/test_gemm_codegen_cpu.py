"""The in-GEMM back end's generator and selection plumbing, without a GPU.

What the generated epilogue visitor tree reads and computes, which programs it takes, how its
modules are keyed, where CUTLASS is found, and how measured selections persist. The kernels
themselves run in test_gemm_epilogue.py on a Hopper GPU.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from fxfuse import expr as E
from fxfuse.cuda import build, gemm_codegen, gemm_info
from fxfuse.cuda.gemm_codegen import Kernel
from fxfuse.cuda.engine import Selection, read_measurement, write_measurement
from fxfuse.cuda.timing import GRAPH_TIMING
from fxfuse.ir import Gemm, Norm, Pointwise, Program, Widen
from fxfuse.report import Report, Row
from fxfuse.vocabulary import call
from programs import PROGRAMS

X = E.X
S01_BF16 = Program.parse("linear(bias=True) | pointwise(bf16(leaky_relu(bf16(x * 2.0), 0.1)))")
SCALAR_AND_COL = Program(Gemm(True), (Pointwise(call("silu", E.add(E.mul(X, E.param(0)), E.param(2)))),),
                         ("scalar", "col", "col"))


def header(program: Program, dtype=torch.bfloat16, params=None) -> str:
    params = params if params is not None else (dtype,) * len(program.params)
    return gemm_codegen.generate(program, dtype, params, "fxg_t", "fx_gemm_info_t")["gemm_program.cuh"]


def trees(text: str) -> list[str]:
    """The ``using Tree = ...;`` lines of a generated header: one a Prog."""
    return [line.strip() for line in text.splitlines() if "using Tree" in line]


def test_the_kernel_computes_in_float32_and_rounds_once_at_the_store():
    """eager's rounding points are dropped; the bias is added to the accumulator."""
    canonical = gemm_codegen.canonical(S01_BF16)
    assert canonical.to_string() == "linear(bias=True) | pointwise(leaky_relu(x * 2.0, 0.1))"
    text = header(S01_BF16)
    assert "fx_round_bf16" not in text
    assert "const float x = acc[e] + in_bias[e];" in text
    assert "fx_leaky_relu(t0, 0.10000000149011612f)" in text


def test_programs_that_differ_only_in_rounding_share_one_module():
    plain = Program.parse("linear(bias=True) | pointwise(leaky_relu(x * 2.0, 0.1))")
    assert gemm_codegen.canonical(plain) == gemm_codegen.canonical(S01_BF16)


def test_the_tree_reads_the_bias_and_each_parameter_the_expression_uses_in_its_own_type():
    text = header(SCALAR_AND_COL, params=(torch.float32, torch.bfloat16, torch.float32))
    (tree,) = trees(text)
    assert tree == ("using Tree = fxg::Tree<fxg::Pointwise<Chain, Out>, fxg::Acc, fxg::Col<Frame, Element>, "
                            "fxg::Scalar<float>, fxg::Col<Frame, float>>;")  # p1 is unused: no leaf
    assert "fxg::scalar_args<float>(a.params[0].ptr)" in text
    assert "fxg::col_args<fxg::Col<Frame, float>>(a.params[2].ptr)" in text
    assert "kParamKinds[3] = {FX_PARAM_SCALAR, FX_PARAM_COL, FX_PARAM_COL}" in text and "kParamDtypes[3] = {FX_F32, FX_BF16, FX_F32}" in text


def test_an_operand_of_the_output_shape_is_a_full_leaf_read_in_its_own_type():
    """A residual or a gate: the tree loads its (M, N) subtile beside the accumulator's (TMA, ahead
    of use) and the expression reads it at the same position."""
    text = header(PROGRAMS["full_gate_silu"])
    (tree,) = trees(text)
    assert tree == ("using Tree = fxg::Tree<fxg::Pointwise<Chain, Out>, fxg::Acc, "
                            "fxg::Full<Frame, cutlass::bfloat16_t>>;")
    assert "fxg::full_args<fxg::Full<Frame, cutlass::bfloat16_t>>(a.params[0].ptr, a.m, a.n)" in text
    assert "kParamKinds[1] = {FX_PARAM_FULL}" in text
    assert "const float t1 = t0 * p0;" in text
    residual = header(PROGRAMS["full_residual"], params=(torch.float32,))
    assert "fxg::Full<Frame, float>" in residual and "const float x = acc[e] + in_bias[e];" in residual


def test_a_program_with_a_second_gemm_gets_two_trees_for_the_selection_to_measure():
    """silu(x Wg^T) * (x Wu^T) + a column scale. Prog reads the second GEMM's output (the runtime
    computes it with cuBLAS) as an operand of the output's shape. GatedProg runs both GEMMs as one
    over the interleaved weights (blocks of 32 rows), a 64-column subtile (32 gate columns, then
    their up columns), the Gated node at the root; the second GEMM's value is the expression's
    parameter, column parameters and the bias are read at the output column. Each tree's kernels
    are units of their own, the module's configurations both sets."""
    sources = gemm_codegen.generate(PROGRAMS["gemm_gate_gelu_scaled"], torch.bfloat16, (torch.bfloat16,) * 2,
                                    "fxg_t", "fx_gemm_info_t")
    text = sources["gemm_program.cuh"]
    assert trees(text) == [
        "using Tree = fxg::Tree<fxg::Pointwise<Chain, Out>, fxg::Acc, fxg::Col<Frame, Element>, "
        "fxg::Full<Frame, cutlass::bfloat16_t>, fxg::Col<Frame, cutlass::bfloat16_t>>;",
        "using Tree = fxg::Tree<fxg::Gated<Gate, 64, Out>, fxg::Acc>;"]
    gated = text[text.index("struct GatedProg"):]
    assert "static constexpr int kGatedBlock = 32;" in gated and "static constexpr int kEpilogueN = 64;" in gated
    assert "kParamKinds[2] = {FX_PARAM_GEMM, FX_PARAM_COL}" in text
    assert "const float x = gate + fxg::load_param<cutlass::bfloat16_t>(a.bias, n);" in text
    assert "const float p0 = up;" in text and "fxg::load_param<cutlass::bfloat16_t>(a.ptr[1], n)" in text
    assert "FX_DEFINE_GEMM_INFO(Prog, fx_gemm_info_t, GatedProg::kGatedBlock)" in sources["main.cu"]
    assert "FX_DEFINE_GEMM_UNIT(GatedProg, Menu::At<2>, gated_2)" in sources["gated_2.cu"]
    assert sorted(sources) == ["config_0.cu", "config_1.cu", "config_2.cu", "config_3.cu", "gated_0.cu", "gated_1.cu",
                               "gated_2.cu", "gated_3.cu", "gemm_program.cuh", "main.cu"]
    plain = header(PROGRAMS["full_gate_silu"])
    assert "static constexpr int kGatedBlock = 0;" in plain and "GatedProg" not in plain


def test_what_the_gated_kernel_takes_the_other_kernels_read_from_cublas():
    """A norm after the product, a residual beside the second GEMM or two second GEMMs: no gated
    kernel, but the module's kernels that read the second GEMM's output still take the program."""
    normed = Program.parse("linear(bias=False) | pointwise(silu(x) * p0) | group_norm(eps=1e-05, groups=4) || gemm")
    residual = Program.parse("linear(bias=False) | pointwise(silu(x) * p0 + p1) || gemm full")
    two = Program.parse("linear(bias=False) | pointwise(silu(x) * p0 * p1) || gemm gemm")
    for program, reason in [(normed, "a norm after a gated pair"), (residual, "beside a second GEMM"),
                            (two, "one second GEMM")]:
        assert reason in gemm_codegen.gated_unsupported_reason(program)
        assert gemm_codegen.unsupported_reason(program, torch.bfloat16) is None
        sources = gemm_codegen.generate(program, torch.bfloat16, (torch.bfloat16,) * len(program.params), "ns", "e")
        assert "GatedProg" not in sources["gemm_program.cuh"] and "gated_0.cu" not in sources
    assert gemm_codegen.gated_unsupported_reason(PROGRAMS["gemm_gate_silu"]) is None
    assert gemm_codegen.gated_unsupported_reason(PROGRAMS["gemm_up_first_silu"]) is None  # silu on the second


def test_an_operand_of_the_output_shape_before_an_in_tile_group_norm_is_taken_after_it_is_not():
    before = Program.parse("linear(bias=True) | pointwise(x + p0) | group_norm(eps=1e-05, groups=256) || full")
    assert gemm_codegen.unsupported_reason(before, torch.bfloat16) is None
    after = Program.parse("linear(bias=True) | group_norm(eps=1e-05, groups=256) | pointwise(x + p0) || full")
    assert "after the group norm" in gemm_codegen.unsupported_reason(after, torch.bfloat16)


def test_a_gemm_without_bias_reads_the_accumulator_alone():
    text = header(PROGRAMS["s14_silu_div_clamp_tanh"])
    assert "const float x = acc[e];" in text and "in_bias" not in text


def test_a_widening_chain_stores_float32():
    program = PROGRAMS["widen_s09_vec_relu"]
    text = header(program, params=(torch.float32,))
    assert "using Out = float;" in text and "kOutDtype = FX_F32" in text
    assert gemm_codegen.canonical(program).widens


def test_one_unit_per_kernel_of_the_menu_and_an_entry_point():
    sources = gemm_codegen.generate(S01_BF16, torch.float16, (), "fxg_t", "fx_gemm_info_t")
    assert sorted(sources) == [*(f"config_{i}.cu" for i in range(7)), "gemm_program.cuh", "main.cu"]
    assert "FX_DEFINE_GEMM_INFO(Prog, fx_gemm_info_t, 0)" in sources["main.cu"]
    assert ("const fxg::Unit kUnits[] = {FX_GEMM_UNIT(0), FX_GEMM_UNIT(1), FX_GEMM_UNIT(2), FX_GEMM_UNIT(3), "
            "FX_GEMM_UNIT(4), FX_GEMM_UNIT(5), FX_GEMM_UNIT(6)};" in sources["main.cu"])
    assert "FX_DEFINE_GEMM_UNIT(Prog, Menu::At<2>, 2)" in sources["config_2.cu"]
    assert "using Element = cutlass::half_t;" in sources["gemm_program.cuh"]
    assert ("using Menu = fxg::Menu<fxg::Config<128, 256, 64, 2, 1, false>, fxg::Config<256, 128, 64, 2, 1, false>, "
            "fxg::Config<128, 128, 64, 2, 1, true>, fxg::Config<128, 128, 64, 1, 2, false>, "
            "fxg::Swapped<64, 16, 128>, fxg::Swapped<64, 32, 128>, fxg::Swapped<64, 64, 128>>;"
            ) in sources["gemm_program.cuh"]


@pytest.mark.parametrize("name", ["s01_scale_leaky", "s22_batch_eval_relu", "full_residual", "identity",
                                  "s04_group_silu_vec_silu", "s02_group_leaky_double"])
def test_a_pointwise_or_in_tile_group_norm_epilogue_adds_the_swapped_kernels_for_few_rows(name):
    """out^T = weight . x^T on a 64-row tile over the output's columns and 16, 32 or 64 over x's
    rows: the in-GEMM kernels for decode sizes. An eval-mode batch norm is pointwise; an operand of the
    output's shape is read transposed with the accumulators; a group of 8-64 columns is 8-64 rows
    of the tile (fxg::SwappedGroupNorm, chosen by the tree's Frame)."""
    program = gemm_codegen.canonical(PROGRAMS[name])
    assert gemm_codegen.menu(program) == gemm_codegen.KERNELS + tuple(
        Kernel(64, width, 128, swapped=True) for width in (16, 32, 64))
    assert "fxg::Swapped<64, 16, 128>, fxg::Swapped<64, 32, 128>, fxg::Swapped<64, 64, 128>>;" in header(program)


def test_a_module_carries_the_kernels_for_the_rows_of_its_calls():
    """Calls of up to 64 rows (decode) get the narrowest swapped kernel whose tile holds their rows
    (KERNELS' 128-row tiles run 1.7-2.0x F.linear there; a wider tile computes padding, a narrower
    one reads the weight again for each tile over the rows), calls of more rows KERNELS alone, a
    module for several kinds of call the kernels of each, the swapped ones last; None: any rows."""
    program = PROGRAMS["s01_scale_leaky"]
    narrow, mid, wide = (Kernel(64, width, 128, swapped=True) for width in (16, 32, 64))
    for rows, kernels in ((1, (narrow,)), (16, (narrow,)), (17, (mid,)), (32, (mid,)), (33, (wide,)), (64, (wide,)),
                          (65, gemm_codegen.KERNELS), (1024, gemm_codegen.KERNELS)):
        assert gemm_codegen.menu(program, gemm_codegen.rows_served(rows)) == kernels, rows
    decode_and_prefill = gemm_codegen.rows_served(16) | gemm_codegen.rows_served(1024)
    assert gemm_codegen.menu(program, decode_and_prefill) == gemm_codegen.KERNELS + (narrow,)
    assert gemm_codegen.rows_served(None) == gemm_codegen.ANY_ROWS
    assert gemm_codegen.menu(program) == gemm_codegen.KERNELS + (narrow, mid, wide)



@pytest.mark.parametrize("name", ["s05_logsumexp_chain", "s20_layer_silu", "s07_vec_batch_train", "gemm_gate_silu"])
def test_a_program_no_swapped_kernel_takes_gets_one_kernel_for_few_rows_and_every_one_for_many(name):
    """A reduction, a norm over the row, a training BatchNorm or a gated pair at up to 64 rows: the
    tree kernels' 128-row tiles lose to the row pass there, so the module carries one of them for
    the selection to measure (its cluster along N), not four to compile; calls of many rows, or a
    module grown for both, every kernel."""
    program = PROGRAMS[name]
    for rows in (1, 16, 64):
        assert gemm_codegen.menu(program, gemm_codegen.rows_served(rows)) == (Kernel(128, 128, cluster_n=2),)
    assert gemm_codegen.FEW_ROWS_TREE in gemm_codegen.KERNELS
    assert gemm_codegen.menu(program, gemm_codegen.rows_served(1024)) == gemm_codegen.KERNELS
    assert gemm_codegen.menu(program, gemm_codegen.rows_served(16) | gemm_codegen.rows_served(1024)) == gemm_codegen.KERNELS
    assert gemm_codegen.menu(program) == gemm_codegen.KERNELS


def test_a_module_is_built_again_for_calls_of_other_rows_and_the_routes_follow_by_name(monkeypatch):
    """A graph compiled at 16 rows builds the module with the 16-wide swapped kernel alone, and the
    selection routes 16-row calls to it (configuration 0); one at 1024 rows builds the module for
    both, registers it in the first's place and routes the 16-row calls again to the swapped
    kernel by its name (now configuration 24); after that calls of 1-16 rows and of more than 64
    build nothing, and one of 40 rows grows the module by the 64-wide kernel, the routes kept. A
    module whose menu has no kernel for few rows serves them as it is."""
    from types import SimpleNamespace

    from fxfuse.cuda.engine import Engine

    built, registered, routes = [], [], {}

    def fake_build_gemm(program, dtype, param_dtypes, target, csrc=None, kernels=None):
        built.append(kernels)
        names = [f"{f'swapped {kernel.tile_n}' if kernel.swapped else kernel.cpp}, {order}" for kernel in kernels
                 for order in range(6)]
        return SimpleNamespace(info=len(built), kernels=kernels, config_names=names)

    monkeypatch.setattr(build, "build_gemm", fake_build_gemm)
    engine = Engine(lambda device: None)
    monkeypatch.setattr(engine, "prepare", lambda *args: None)  # the row path's module
    engine._runtime_module = SimpleNamespace(
        register_gemm=lambda *args: registered.append(args[-1]),
        choose=lambda program, dtype, device, m, n, k, config: routes.__setitem__((m, n, k), config))
    program, device, bf16 = PROGRAMS["s01_scale_leaky"], torch.device("cpu"), torch.bfloat16
    narrow = gemm_codegen.FEW_ROWS_KERNELS[0]  # the 16-wide tile
    few = engine.prepare_gemm(program, bf16, (), device, gemm_codegen.rows_served(16))
    assert few.kernels == (narrow,)
    key = ((program.to_string(), bf16, -1), ())
    engine.selections[(*key, 8192, 8192, 4, False, False)] = Selection("swapped 16, 0", 0, {"swapped 16, 0": 34.0},
                                                                     GRAPH_TIMING)
    both = engine.prepare_gemm(program, bf16, (), device, gemm_codegen.rows_served(1024))
    assert both.kernels == gemm_codegen.KERNELS + (narrow,) and registered == [1, 2]
    assert routes == {(16, 8192, 8192): 24} and engine.selections[(*key, 8192, 8192, 4, False, False)].config == 24
    for rows in (1, 16, 100, 1024):
        assert engine.prepare_gemm(program, bf16, (), device, gemm_codegen.rows_served(rows)) is both
    assert len(built) == 2
    grown = engine.prepare_gemm(program, bf16, (), device, gemm_codegen.rows_served(40))  # the 64-wide tile's
    assert grown.kernels == gemm_codegen.KERNELS + (narrow, gemm_codegen.FEW_ROWS_KERNELS[2])
    assert routes == {(16, 8192, 8192): 24} and len(built) == 3
    layer_norm = PROGRAMS["s20_layer_silu"]  # no kernel for few rows in its menu: nothing to build again
    held = engine.prepare_gemm(layer_norm, bf16, (), device, gemm_codegen.rows_served(1024))
    assert engine.prepare_gemm(layer_norm, bf16, (), device, gemm_codegen.rows_served(16)) is held
    assert len(built) == 4


def test_float32_calls_while_torch_does_not_allow_tf32_get_no_gemm_module_built_or_timed(monkeypatch, tmp_path):
    """A float32 GEMM is TF32 in the in-GEMM path, and while torch does not allow TF32 the runtime
    runs such calls on cuBLAS and the row pass whatever their route. So the selection builds no
    module for them (minutes of CUTLASS for no call) and times the row path against Inductor; with
    TF32 allowed it builds the module and times its configurations."""
    import sys
    from types import SimpleNamespace

    from fxfuse.cuda.engine import Engine

    engine_module = sys.modules["fxfuse.cuda.engine"]  # fxfuse.cuda.engine is the GPU's Engine
    built, timed, prepared = [], [], []
    engine = Engine(lambda device: None)
    monkeypatch.setattr(engine, "prepare_gemm", lambda program, dtype, params, device, served:
                        built.append(dtype) or SimpleNamespace(key="gemm module"))
    monkeypatch.setattr(engine, "_measure", lambda program, dtype, params, shape, device, has_bias, module, *rest:
                        timed.append(module) or Selection("row", -1, {"row": 1.0, "Inductor": 2.0}, GRAPH_TIMING))
    monkeypatch.setattr(engine_module, "_selection_file", lambda key, shape, bucket, device: tmp_path / key)
    engine._runtime_module = SimpleNamespace(bucket_of=lambda m: 9, choose=lambda *args: None)
    program, f32, device = PROGRAMS["reduce_sum_keep"], torch.float32, torch.device("cpu")
    monkeypatch.setattr(engine, "prepare", lambda *args: prepared.append(args[1]))  # the row module
    engine._modules[(program.to_string(), f32, -1)] = SimpleNamespace(key="row module")

    def select(against_inductor):
        return engine.select(program, f32, (f32,), (512, 1024, 256), device, True, against_inductor=against_inductor)

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    assert select(against_inductor=False) is None
    assert select(against_inductor=True).path == "row" and built == [] and timed == [None] and f32 in prepared
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    select(against_inductor=True)
    assert built == [f32] and timed[-1].key == "gemm module"


def test_the_selection_times_the_kernels_built_for_the_calls_rows():
    """A module grown for every kind of call times, for few rows, the swapped kernel for them and
    the others for many; a module without a kernel for the call's rows times all it has."""
    narrow, mid, wide = gemm_codegen.FEW_ROWS_KERNELS
    every = gemm_codegen.KERNELS + gemm_codegen.FEW_ROWS_KERNELS
    for rows, kernels in ((1, (narrow,)), (16, (narrow,)), (17, (mid,)), (64, (wide,)), (65, gemm_codegen.KERNELS)):
        assert gemm_codegen.timed_for(every, rows) == kernels
    assert gemm_codegen.timed_for(gemm_codegen.KERNELS, 16) == gemm_codegen.KERNELS
    assert gemm_codegen.timed_for(gemm_codegen.KERNELS + (narrow,), 40) == gemm_codegen.KERNELS + (narrow,)


def test_a_gemm_modules_configurations_are_its_kernels_at_each_tile_order():
    from types import SimpleNamespace

    module = SimpleNamespace(kernels=gemm_codegen.KERNELS + gemm_codegen.FEW_ROWS_KERNELS)
    kernel_of = build.GemmModule.kernel_of.__get__(module)
    schedules = gemm_codegen.SCHEDULES
    assert [kernel_of(config) for config in range(0, 7 * schedules, schedules)] == list(module.kernels)
    assert kernel_of(4 * schedules + schedules - 1).swapped and not kernel_of(4 * schedules - 1).swapped
    assert kernel_of(7 * schedules) == module.kernels[0]  # a gated module's second tree


def test_a_graph_of_many_rows_after_one_of_few_builds_the_grown_module_once(monkeypatch):
    """prepare_many for a program whose module is held for calls of few rows: the one module it
    builds (or finds in the cache) is the one the engine then loads, with the kernels for both
    kinds of call, not a module of many rows' kernels built for nothing on the way."""
    from types import SimpleNamespace

    from fxfuse.cuda.engine import Engine

    asked, built = [], []

    def fake_build_gemm(program, dtype, param_dtypes, target, csrc=None, kernels=None):
        built.append(kernels)
        return SimpleNamespace(info=len(built), kernels=kernels, config_names=[])

    monkeypatch.setattr(build, "build_gemm", fake_build_gemm)
    monkeypatch.setattr(build, "gemm_target_reason", lambda target: None)
    monkeypatch.setattr(build, "is_built", lambda *args: asked.append(args[4]) or True)  # cached: no worker
    engine = Engine(lambda device: None)
    monkeypatch.setattr(engine, "prepare", lambda *args: None)
    engine._runtime_module = SimpleNamespace(register_gemm=lambda *args: None, choose=lambda *args: None)
    program, device, bf16 = PROGRAMS["s01_scale_leaky"], torch.device("cpu"), torch.bfloat16
    assert not engine.prepare_many([], device, gemm_items=[(program, bf16, (), 16)])
    narrow = gemm_codegen.FEW_ROWS_KERNELS[0]
    assert built == [(narrow,)]
    asked.clear()
    assert not engine.prepare_many([], device, gemm_items=[(program, bf16, (), 1024)])
    both = gemm_codegen.KERNELS + (narrow,)
    assert asked == [None, both] and built[1:] == [both]  # the runtime's job, then the module's
    assert not engine.prepare_many([], device, gemm_items=[(program, bf16, (), 16), (program, bf16, (), 1024)])
    assert len(built) == 2


def test_a_gemm_module_whose_build_failed_in_a_worker_is_not_built_again_in_the_compiling_process(monkeypatch):
    """It would fail alike, minutes later: the worker's error is the module's (gemm_error says it),
    its program stays on the row path, and later calls do not try again."""
    from types import SimpleNamespace

    from fxfuse.cuda.engine import Engine

    built = []
    monkeypatch.setattr(build, "gemm_target_reason", lambda target: None)
    monkeypatch.setattr(build, "build_many", lambda jobs, target, workers=None: {
        job: "nvcc: out of memory" if job.param_dtypes is not None else None for job in jobs})
    monkeypatch.setattr(build, "build_gemm", lambda *args, **kwargs: built.append(args))
    engine = Engine(lambda device: None)
    monkeypatch.setattr(engine, "prepare", lambda *args: None)
    program, device, bf16 = PROGRAMS["s01_scale_leaky"], torch.device("cpu"), torch.bfloat16
    assert not engine.prepare_many([(program, bf16)], device, gemm_items=[(program, bf16, (), 1024)])
    assert engine.gemm_error(program, bf16, (), device) == "nvcc: out of memory" and not built
    assert engine.prepare_gemm(program, bf16, (), device) is None and not built


@pytest.mark.parametrize("name", ["s05_logsumexp_chain", "s20_layer_silu", "s11_gelu_softmax", "s07_vec_batch_train",
                                  "gemm_gate_silu"])
def test_row_and_column_statistics_reductions_and_second_gemms_keep_the_menu_without_the_swapped_kernel(name):
    """Their register nodes read the accumulators by the output's rows and columns, and a gated
    module's second tree has a unit per kernel of the plain one's."""
    program = gemm_codegen.canonical(PROGRAMS[name])
    assert gemm_codegen.menu(program) == gemm_codegen.KERNELS
    assert "Swapped" not in header(program)
    with pytest.raises(ValueError, match="swapped kernel's epilogue is pointwise or an in-tile group norm"):
        gemm_codegen.generate(program, torch.bfloat16, (torch.bfloat16,) * len(program.params), "n", "e",
                              gemm_codegen.KERNELS + gemm_codegen.FEW_ROWS_KERNELS)


def test_a_module_built_with_another_menu_has_a_unit_per_kernel():
    menu = (Kernel(256, 128, cluster_n=2), Kernel(64, 256, pingpong=True))
    sources = gemm_codegen.generate(S01_BF16, torch.bfloat16, (), "fxg_t", "fx_gemm_info_t", menu)
    assert sorted(sources) == ["config_0.cu", "config_1.cu", "gemm_program.cuh", "main.cu"]
    assert ("using Menu = fxg::Menu<fxg::Config<256, 128, 64, 1, 2, false>, fxg::Config<64, 256, 64, 1, 1, true>>;"
            in sources["gemm_program.cuh"])


def test_a_kernel_launched_as_a_programmatic_dependent_alone_enables_cutlass_grid_control():
    """pdl (a kernel that may start while the one before it drains, and lets the kernels after it
    start early) is named in its Config; only its unit defines CUTLASS_ENABLE_GDC_FOR_SM90, before
    CUTLASS's headers, and the menu's other kernels keep their text, and so their modules' keys."""
    sources = gemm_codegen.generate(S01_BF16, torch.bfloat16, (), "fxg_t", "fx_gemm_info_t",
                                    (Kernel(256, 128, cluster_m=2, pdl=True), Kernel(128, 128, cluster_m=2, pingpong=True)))
    assert ("using Menu = fxg::Menu<fxg::Config<256, 128, 64, 2, 1, false, true>, "
            "fxg::Config<128, 128, 64, 2, 1, true>>;") in sources["gemm_program.cuh"]
    unit = sources["config_0.cu"]
    assert unit.index("#define CUTLASS_ENABLE_GDC_FOR_SM90") < unit.index('#include "gemm_program.cuh"')
    assert "CUTLASS_ENABLE_GDC_FOR_SM90" not in sources["config_1.cu"] + sources["main.cu"]


def test_a_build_with_fewer_cores_than_kernels_compiles_a_file_per_core_kernels_of_a_kind_together():
    """A CUTLASS unit's compile is mostly parsing, so with two cores for S01's seven kernels the
    module compiles two files: its four kernels for many rows, and its three swapped ones. The
    units and the entry's table are the same as with a file each."""
    one_each = gemm_codegen.generate(S01_BF16, torch.bfloat16, (), "fxg_t", "fx_gemm_info_t")
    two = gemm_codegen.generate(S01_BF16, torch.bfloat16, (), "fxg_t", "fx_gemm_info_t", files=2)
    assert sorted(two) == ["gemm_program.cuh", "main.cu", "units_0.cu", "units_1.cu"]
    assert two["main.cu"] == one_each["main.cu"] and two["gemm_program.cuh"] == one_each["gemm_program.cuh"]
    defined = {file: [line for line in text.splitlines() if line.startswith("FX_DEFINE_GEMM_UNIT")]
               for file, text in two.items() if file.startswith("units_")}
    assert defined == {"units_0.cu": [f"FX_DEFINE_GEMM_UNIT(Prog, Menu::At<{i}>, {i})" for i in range(4)],
                       "units_1.cu": [f"FX_DEFINE_GEMM_UNIT(Prog, Menu::At<{i}>, {i})" for i in range(4, 7)]}
    assert sorted(gemm_codegen.generate(S01_BF16, torch.bfloat16, (), "fxg_t", "fx_gemm_info_t", files=7)) == sorted(
        one_each)


def test_grouped_units_keep_kinds_and_programmatic_dependents_apart_and_at_most_four_to_a_file():
    many, swapped, pdl = ("Prog", False, False), ("Prog", True, False), ("Prog", False, True)
    assert gemm_codegen.grouped_units([many] * 4 + [swapped] * 3, 3) == [[0, 1], [2, 3], [4, 5, 6]]
    assert gemm_codegen.grouped_units([many] * 4 + [swapped] * 3, 1) == [[0, 1, 2, 3], [4, 5, 6]]
    assert gemm_codegen.grouped_units([many, pdl, many], 1) == [[0], [1], [2]]
    assert gemm_codegen.grouped_units([many] * 8 + [("GatedProg", False, False)] * 8, 2) == [
        [0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert gemm_codegen.grouped_units([many] * 4, None) == gemm_codegen.grouped_units([many] * 4, 4) == [[0], [1], [2], [3]]


@pytest.mark.parametrize("name,dtype,reason", [
    ("s01_scale_leaky", torch.float64, "bfloat16, float16 and (as TF32) float32"),
    ("widen_rms_then_group", torch.bfloat16, "more than one norm or reduction"),
    ("reduce_var_keep", torch.bfloat16, "var reductions are not in the in-GEMM epilogue"),
    ("reduce_sum_keep_broadcast", torch.bfloat16, "only scalars are read after a row reduction"),
    ("keep_residual_layer", torch.bfloat16, "keep stages"),
    ("dropout_residual_layer", torch.bfloat16, "dropout stages"),
])
def test_programs_the_in_gemm_path_does_not_take_yet(name, dtype, reason):
    assert reason in gemm_codegen.unsupported_reason(PROGRAMS[name], dtype)
    with pytest.raises(ValueError):
        gemm_codegen.generate(PROGRAMS[name], dtype, (dtype,) * len(PROGRAMS[name].params), "n", "e")


def test_a_float32_gemm_takes_the_in_gemm_path_only_while_torch_allows_tf32(monkeypatch):
    """Its calls go to cuBLAS while TF32 is off; its module is still generated (a build worker
    starts with TF32 off, building for a parent that allows it)."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    assert "allow_tf32 is off" in gemm_codegen.unsupported_reason(PROGRAMS["s01_scale_leaky"], torch.float32)
    assert gemm_codegen.build_reason(PROGRAMS["s01_scale_leaky"], torch.float32) is None
    assert "main.cu" in gemm_codegen.generate(PROGRAMS["s01_scale_leaky"], torch.float32, (), "n", "e")


def test_a_norm_or_softmax_over_the_row_keeps_statistics_per_row_and_subtile_for_a_pass_after_the_gemm():
    """LayerNorm, RMSNorm, softmax, log_softmax and F.normalize span more columns than a tile: the
    epilogue stores the map's input and its statistics per (row, 64-column subtile) (a LayerNorm's
    mean and M2, an RMSNorm's or normalize's sum of squares, a softmax's max and sum of exponentials), and
    fxg::normalize_rows finishes each row with the norm's weight and bias (1 and 0 for a softmax)
    and the stages after the map (csrc/gemm_row_statistics.cuh)."""
    kinds = {"s20_layer_silu": "kRowLayerNorm", "s21_rms_silu": "kRowRmsNorm", "s11_gelu_softmax": "kRowSoftmax",
             "log_softmax_then_pointwise": "kRowLogSoftmax", "normalize_then_col": "kRowNormalize"}
    texts = {name: header(PROGRAMS[name]) for name in kinds}
    for name, text in texts.items():
        kind = kinds[name]
        assert f"fxg::Tree<fxg::RowStatistics<64, fxg::{kind}>, fxg::Tree<fxg::Pointwise<Chain, float>" in text, name
        assert f"kRowStatistic = fxg::{kind};" in text and "kReduceKind = -1;" in text
        assert "using NormAffine = Affine;" in text and "using NormPost = After;" in text
        assert "n <= fxg::kRowStatisticsMaxN" in text and "kOutKind = FX_OUT_ROWS;" in text
    assert "kNormEps = 9.999999747378752e-06f;" in texts["s20_layer_silu"]
    assert "fx_silu(x)" in texts["s21_rms_silu"] and "return 0.f; }" in texts["s21_rms_silu"]  # no bias
    assert "fx_gelu(x)" in texts["s11_gelu_softmax"]  # before the softmax, in the epilogue
    assert "return 1.f; }" in texts["s11_gelu_softmax"] and "return 0.f; }" in texts["s11_gelu_softmax"]
    assert "kNormEps = 9.999999960041972e-13f;" in texts["normalize_then_col"]  # F.normalize's eps
    assert "kRowStatistic = -1;" in header(PROGRAMS["s01_scale_leaky"])


def test_a_float32_gemm_is_taken_as_tf32_while_torch_allows_tf32(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    assert gemm_codegen.unsupported_reason(PROGRAMS["s01_scale_leaky"], torch.float32) is None
    text = header(PROGRAMS["s01_scale_leaky"], torch.float32)
    assert "using Element = float;" in text and "kDtype = FX_F32;" in text


def test_a_function_with_jumps_goes_to_the_row_pass():
    """floor(y), sign(y), threshold(y, ...): the in-GEMM epilogue reads the float32 accumulator,
    not eager's rounded GEMM output, and a step would turn that last-bit difference into a jump."""
    for text in ("floor(x * 4.0)", "relu(x) + sign(x)", "threshold(x, 0.1, 2.0)", "hardshrink(x, 0.5)"):
        program = Program.parse(f"linear(bias=True) | pointwise({text})")
        assert "a step turns" in gemm_codegen.unsupported_reason(program, torch.bfloat16), text
    assert gemm_codegen.unsupported_reason(Program.parse("linear(bias=True) | pointwise(log1p(abs(x)))"),
                                           torch.bfloat16) is None


def test_the_pointwise_suite_programs_are_taken():
    for name in ("s01_scale_leaky", "s10_div_gelu", "s13_sub_mul_relu", "s14_silu_div_clamp_tanh", "identity"):
        assert gemm_codegen.unsupported_reason(PROGRAMS[name], torch.bfloat16) is None, name


def test_the_suite_group_norm_chains_are_taken():
    for name in ("s02_group_leaky_double", "s04_group_silu_vec_silu", "s17_vec_hardtanh_mish_group",
                 "widen_s08_silu_vec_group"):
        assert gemm_codegen.unsupported_reason(PROGRAMS[name], torch.bfloat16) is None, name


def test_the_suite_row_reduction_chains_are_taken():
    for name in ("s05_logsumexp_chain", "s15_div_sum_mul", "s16_sigmoid_sum", "reduce_max_keep", "reduce_min_drop",
                 "reduce_mean_drop", "reduce_logsumexp_keep", "reduce_vector_norm_keep"):
        assert gemm_codegen.unsupported_reason(PROGRAMS[name], torch.bfloat16) is None, name


def test_a_row_reduction_folds_partials_in_the_epilogue_and_runs_the_stages_after_it_in_a_finalize():
    """S05: the bias is the epilogue's only pointwise work; the tree ends in a RowReduce node (no
    M x N store: one value a row, kept as (M, 1)); the LeakyReLUs and GELUs run once a row."""
    text = header(PROGRAMS["s05_logsumexp_chain"])
    (tree,) = trees(text)
    assert tree.startswith("using Tree = fxg::Tree<fxg::RowReduce<Frame, fxg::kLogSumExp, 64>,")
    assert "kOutKind = FX_OUT_REDUCED_KEEP" in text and "kReduceKind = fxg::kLogSumExp" in text
    chain = text[text.index("struct Chain"):text.index("struct RowFinalize")]
    assert "fx_gelu" not in chain and "out[e] = x;" in chain
    finalize = text[text.index("struct RowFinalize"):text.index("struct Prog")]
    assert finalize.count("fx_leaky_relu") == 2 and finalize.count("fx_gelu") == 2
    assert "kOutKind = FX_OUT_REDUCED;" in header(PROGRAMS["reduce_min_drop"])
    assert "using Out = float;" in header(PROGRAMS["widen_s05_logsumexp_chain"])  # a widened chain's value a row


def test_a_group_norm_chain_is_its_stages_before_and_after_the_norm_without_rounding_points():
    program = Program.parse("linear(bias=True) | pointwise(bf16(bf16(x * 2.0) + p0)) | "
                            "group_norm(eps=1e-05, groups=8, weight=p1, bias=p2) | pointwise(bf16(relu(x))) | "
                            "pointwise(bf16(x * p3)) || col col col scalar")
    assert gemm_codegen.canonical(program).to_string() == (
        "linear(bias=True) | pointwise((x * 2.0) + p0) | group_norm(eps=1e-05, groups=8, weight=p1, bias=p2) | "
        "pointwise(relu(x) * p3) || col col col scalar")


def test_the_group_norm_stage_takes_the_values_before_it_in_float32_and_applies_the_rest_per_column():
    program = PROGRAMS["s04_group_silu_vec_silu"]  # group norm (weight p0, bias p1), silu, x p2, silu
    text = header(program, params=(torch.float32, torch.bfloat16, torch.float16))
    (tree,) = trees(text)
    assert tree == ("using Tree = fxg::Tree<fxg::GroupNormFor<Frame, Post, 64>, fxg::Tree<fxg::Pointwise<Chain, float>, "
                            "fxg::Acc, fxg::Col<Frame, Element>>>;")
    assert "const float p0 = fxg::load_param<float>(a.ptr[0], n);" in text
    assert "const float p1 = fxg::load_param<cutlass::bfloat16_t>(a.ptr[1], n);" in text
    assert "const float p2 = fxg::load_param<cutlass::half_t>(a.ptr[2], n);" in text
    assert "static constexpr int kEpilogueN = 64;" in text and "kGroups = 8;" in text
    assert "{static_cast<int32_t>(a.n / kGroups), 1e-05f, Post::args(a)}" in text
    assert "64 % (n / kGroups) == 0" in text  # groups of 8-64 columns: whole blocks inside the subtile


def test_a_scalar_after_the_norm_is_read_once_not_per_column():
    program = Program.parse("linear(bias=False) | group_norm(eps=0.001, groups=4) | pointwise(x * p0) || scalar")
    text = header(program)
    assert "return {fxg::load_param<cutlass::bfloat16_t>(a.ptr[0], 0)};" in text  # Post::scalars, once a subtile
    assert "const float p0 = s.p0;" in text
    assert "1e-03f" in text or "0.001f" in text


def test_a_training_batch_norm_takes_column_moments_in_the_gemm_and_normalizes_after_it():
    text = header(PROGRAMS["s07_vec_batch_train"])  # x * p0, then batch_norm(weight=p1, bias=p2)
    assert trees(text) == ["using Tree = fxg::Tree<fxg::ColumnMoments<64>, fxg::Tree<fxg::Pointwise<Chain, float>, "
                           "fxg::Acc, fxg::Col<Frame, Element>, fxg::Col<Frame, cutlass::bfloat16_t>>>;"]
    assert "static constexpr bool kBatchTrain = true;" in text and "static constexpr int kEpilogueN = 64;" in text
    assert "using NormAffine = Affine;" in text and "using NormPost = After;" in text
    assert "static float weight(const Arguments& a, int64_t n) { (void)a; (void)n; return fxg::load_param<cutlass::bfloat16_t>(a.ptr[1], n); }" in text
    assert "return fxg::load_param<cutlass::bfloat16_t>(a.ptr[2], n); }" in text
    assert "static constexpr bool kChannelsDim1 = true;" in text  # torch takes dim 1 as channels: 2-D x only
    plain = header(Program(Gemm(False), (Norm("batch", 1e-3, training=True),)))
    assert "return 1.f; }" in plain and "return 0.f; }" in plain  # no weight, no bias
    assert "static constexpr bool kBatchTrain = false;" in header(PROGRAMS["s01_scale_leaky"])


def test_an_eval_mode_batch_norm_is_a_pointwise_stage_of_the_chain():
    """Its statistics are the running ones: per column (x - mean) / sqrt(var + eps) * weight + bias,
    composed with the stages around it into the one expression on the accumulator."""
    program = PROGRAMS["vec_batch_eval_silu_scalar"]  # x * p0 | batch_norm(weight=p1, mean=p2, var=p3) | silu(x) + p4
    assert gemm_codegen.unsupported_reason(program, torch.bfloat16) is None
    text = header(program)
    assert trees(text) == ["using Tree = fxg::Tree<fxg::Pointwise<Chain, Out>, fxg::Acc, "
                           + ", ".join(["fxg::Col<Frame, cutlass::bfloat16_t>"] * 4) + ", fxg::Scalar<cutlass::bfloat16_t>>;"]
    for line in ("const float t0 = x * p0;", "const float t1 = t0 - p2;", "const float t2 = p3 + 0.0010000000474974513f;",
                 "const float t3 = 1.0f / sqrtf(t2);", "const float t4 = t1 * t3;", "const float t5 = t4 * p1;",
                 "const float t6 = fx_silu(t5);", "const float t7 = t6 + p4;", "out[e] = t7;"):
        assert line in text
    assert "static constexpr bool kBatchTrain = false;" in text and "ColumnMoments" not in text
    assert "static constexpr bool kChannelsDim1 = true;" in text  # torch takes dim 1 as channels: 2-D x only
    # the module's key keeps the norm a stage (its facts follow from it), rounding points dropped around it
    assert gemm_codegen.canonical(program).to_string() == (
        "linear(bias=False) | pointwise(x * p0) | batch_norm(eps=0.001, weight=p1, running_mean=p2, running_var=p3) "
        "| pointwise(silu(x) + p4) || col col col col scalar")
    # beside a norm with statistics of its own, it is the pointwise stage before that norm
    before_group = Program(Gemm(True), (Norm("batch", 1e-5, running_mean=0, running_var=1),
                                        Norm("group", 1e-5, groups=4)), ("col", "col"))
    assert gemm_codegen.unsupported_reason(before_group, torch.bfloat16) is None
    assert "fxg::GroupNormFor<Frame, Post, 64>" in trees(header(before_group))[0]


@pytest.mark.parametrize("n,groups,size", [(8192, 512, 16), (8192, 256, 32), (4096, 64, 64), (264, 33, 8),
                                           (8192, 16, None), (96, 4, None), (100, 10, None), (8192, 5, None)])
def test_group_sizes_inside_the_subtile(n, groups, size):
    assert gemm_codegen.group_size(Norm("group", 1e-5, groups=groups), n) == size


def test_parameters_of_other_dtypes_reach_the_kernel_as_float32():
    assert gemm_codegen.kernel_param_dtype(torch.float64) == torch.float32
    assert gemm_codegen.kernel_param_dtype(torch.bfloat16) == torch.bfloat16


def test_cutlass_is_found_through_cutlass_path(tmp_path, monkeypatch):
    include = tmp_path / "include" / "cutlass"
    include.mkdir(parents=True)
    (include / "cutlass.h").write_text("")
    (include / "version.h").write_text("#define CUTLASS_MAJOR 4\n#define CUTLASS_MINOR 2\n#define CUTLASS_PATCH 0\n")
    monkeypatch.setenv("CUTLASS_PATH", str(tmp_path))
    assert build.cutlass_include() == tmp_path / "include"
    assert build.cutlass_version(tmp_path / "include") == "4.2.0"


def test_gemm_modules_are_built_for_hopper_only(monkeypatch):
    monkeypatch.setattr(build, "cutlass_include", lambda: Path("/somewhere"))
    assert build.gemm_target_reason(build.Target("cuda", "sm_90a")) is None
    assert "sm_90a" in build.gemm_target_reason(build.Target("cuda", "sm_80"))
    assert "sm_90a" in build.gemm_target_reason(build.Target("emulate", "emulate"))
    monkeypatch.setattr(build, "cutlass_include", lambda: None)
    assert "fxfuse[cutlass]" in build.gemm_target_reason(build.Target("cuda", "sm_90a"))


def test_a_selection_survives_on_disk_and_a_corrupt_one_is_measured_again(tmp_path):
    selection = Selection("cooperative, raster M", 1, {"row": 12.5, "cooperative, raster M": 10.0}, GRAPH_TIMING)
    path = tmp_path / "selections" / "s.json"
    write_measurement(path, selection)
    assert read_measurement(path, Selection) == selection
    path.write_text("{not json")
    assert read_measurement(path, Selection) is None
    path.write_text('{"path": "row", "config": -1, "times_us": {"row": 12.5}}')
    assert read_measurement(path, Selection) is None  # timed before the method was recorded: measured again
    assert "in-GEMM epilogue (cooperative, raster M)" in selection.describe()
    assert "measured (CUDA-graph replay)" in selection.describe()
    assert "row 12.5 us" in Selection("row", -1, {"row": 12.5}, GRAPH_TIMING).describe()


def test_a_selection_names_each_kernel_at_its_fastest_tile_order_fastest_first():
    times = {"row": 12.5, "Inductor": 11.0, "cooperative 128x256x64 cluster 2x1, raster M": 10.0,
             "cooperative 128x256x64 cluster 2x1, raster N": 10.5, "pingpong 128x128x64 cluster 2x1, raster M": 13.0,
             "pingpong 128x128x64 cluster 2x1, raster N swizzle 2": 12.0}
    said = Selection("cooperative 128x256x64 cluster 2x1, raster M", 1, times, GRAPH_TIMING).describe()
    assert said.endswith("measured (CUDA-graph replay) (each kernel at its fastest tile order): "
                         "cooperative 128x256x64 cluster 2x1, raster M 10.0 us, Inductor 11.0 us, "
                         "pingpong 128x128x64 cluster 2x1, raster N swizzle 2 12.0 us, row 12.5 us")


def test_the_report_shows_the_gpu_path_when_there_is_one():
    row = Row(0, "linear", "fused", ["linear", "relu"], ["linear", "relu"], None, "linear(bias=True) | "
              "pointwise(relu(x))", "bfloat16", path="in-GEMM epilogue (cooperative); measured: ...")
    assert "GPU path" in str(Report([row]))
    assert "GPU path" not in str(Report([Row(0, "linear", "fused", [], [], None, None, None)]))


@pytest.mark.skipif(shutil.which("nvcc") is None or build.cutlass_include() is None,
                    reason="needs nvcc and the CUTLASS headers (pip install 'fxfuse[cutlass]')")
def test_a_generated_unit_compiles_for_sm90a(tmp_path):
    sources = gemm_codegen.generate(SCALAR_AND_COL, torch.bfloat16, (torch.float32,) * 3, "fxg_t", "fx_gemm_info_t")
    for name, text in sources.items():
        (tmp_path / name).write_text(text)
    import subprocess

    result = subprocess.run(
        ["nvcc", "-std=c++17", "--expt-relaxed-constexpr", "-DNDEBUG", "-gencode=arch=compute_90a,code=sm_90a",
         f"-I{build.CSRC}", f"-I{build.cutlass_include()}", f"-I{tmp_path}", "-c", str(tmp_path / "main.cu"),
         "-o", str(tmp_path / "main.o")],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.skipif(shutil.which("nvcc") is None or build.cutlass_include() is None,
                    reason="needs nvcc and the CUTLASS headers (pip install 'fxfuse[cutlass]')")
def test_a_modules_size_queries_answer_on_the_host_for_every_configuration(tmp_path):
    """supports and workspace run CUTLASS's host checks on a launch without data, built with the
    module's own flags (-O3): a tree that reads parameters (S17: a column before the in-tile group
    norm) reads the launch's parameter table there too, which must not be a null pointer. The
    queries run first in a process of their own (build.probe_size_queries), so that a crash fails
    this test alone."""
    import ctypes
    import subprocess

    program = gemm_codegen.canonical(PROGRAMS["s17_vec_hardtanh_mish_group"])
    kernels = (gemm_codegen.KERNELS[0], gemm_codegen.KERNELS[1], gemm_codegen.FEW_ROWS_KERNELS[1])
    # as a build on one core compiles them: the two kernels for many rows in one file, the swapped one in another
    sources = gemm_codegen.generate(program, torch.bfloat16, (torch.bfloat16,) * 3, "fxg_t", "fx_gemm_info_t",
                                    kernels, files=1)
    assert sorted(sources) == ["config_2.cu", "gemm_program.cuh", "main.cu", "units_0.cu"]
    for name, text in sources.items():
        (tmp_path / name).write_text(text)
    target = build.Target("cuda", *build.arch_flags(9, 0))
    flags = build._compiler_flags(target, build.cutlass_include())["extra_cuda_cflags"]
    units = [name for name in sources if name.endswith(".cu")]
    compiles = [subprocess.Popen(["nvcc", *flags, f"-I{build.CSRC}", f"-I{tmp_path}", "-Xcompiler", "-fPIC", "-c",
                                  str(tmp_path / unit), "-o", str(tmp_path / f"{unit}.o")],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for unit in units]
    for process in compiles:
        log = process.communicate(timeout=900)[0]
        assert process.returncode == 0, log[-3000:]
    library = tmp_path / "module.so"
    linked = subprocess.run(["nvcc", "-shared", "-o", str(library), *[str(tmp_path / f"{u}.o") for u in units]],
                            capture_output=True, text=True, timeout=300)
    assert linked.returncode == 0, linked.stderr[-3000:]
    build.probe_size_queries(library, "fx_gemm_info_t")  # what a build runs: raises where the queries crash
    entry = ctypes.CDLL(str(library)).fx_gemm_info_t  # then safe to load here
    entry.restype = ctypes.c_void_p
    info = gemm_info.GemmInfoView.from_address(entry())
    assert info.num_configs == len(kernels) * gemm_codegen.SCHEDULES
    shapes = [(1, 64, 72), (7, 256, 264), (300, 128, 520), (1024, 512, 512)]
    # S17's four groups: of 16, 64 and 32 columns each kernel covers at its first tile order, of 128
    # (wider than the subtile) none
    configs = range(info.num_configs)
    covered = {(m, config) for m, n, k in shapes for config in configs if info.supports(m, n, k, config)}
    assert {(m, i * gemm_codegen.SCHEDULES) for m in (1, 7, 300) for i in range(len(kernels))} <= covered
    assert not any(m == 1024 for m, _ in covered)
    assert all(info.workspace(m, n, k, 132, config) >= 0 for m, n, k in shapes for config in configs)


@pytest.fixture
def fake_cutlass(tmp_path, monkeypatch) -> Path:
    """CUTLASS_PATH at headers that only say their version (4.2.0), all a key reads of them; their
    include directory."""
    include = tmp_path / "include"
    (include / "cutlass").mkdir(parents=True)
    (include / "cutlass" / "cutlass.h").write_text("")
    (include / "cutlass" / "version.h").write_text("#define CUTLASS_MAJOR 4\n#define CUTLASS_MINOR 2\n"
                                                   "#define CUTLASS_PATCH 0\n")
    monkeypatch.setenv("CUTLASS_PATH", str(tmp_path))
    build.cutlass_version.cache_clear()
    yield include
    build.cutlass_version.cache_clear()


def test_gemm_modules_are_keyed_on_the_kernel_program_parameter_dtypes_and_cutlass(tmp_path, monkeypatch,
                                                                                   fake_cutlass):
    """What build_gemm hands the compiler: the CUTLASS include, a unit per kernel (grouped into a
    file per compile it may run at once where those are fewer), a key that two spellings of one
    kernel share and parameter dtypes, another menu or another CUTLASS version change, and the
    grouping does not."""
    include, version = fake_cutlass, fake_cutlass / "cutlass" / "version.h"
    built = []

    def fake_build(key, kind, label, name, entry, sources, target, csrc, cutlass=None, manifest=None):
        built.append(dict(key=key, label=label, sources=sorted(sources), cutlass=cutlass))
        return None, 0, tmp_path / "lib.so"

    monkeypatch.setenv("FXFUSE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_build_generated", fake_build)
    monkeypatch.setenv("MAX_JOBS", "16")
    target = build.Target("cuda", "sm_90a", (), None)
    plain = Program.parse("linear(bias=True) | pointwise(leaky_relu(x * 2.0, 0.1))")
    keys = [build.build_gemm(p, torch.bfloat16, (), target).key for p in (S01_BF16, plain)]
    assert keys[0] == keys[1]
    assert built[0]["cutlass"] == include and built[0]["label"].startswith("in-GEMM ")
    assert built[0]["sources"] == [*(f"config_{i}.cu" for i in range(7)), "gemm_program.cuh", "main.cu"]
    monkeypatch.setenv("MAX_JOBS", "2")
    assert build.build_gemm(S01_BF16, torch.bfloat16, (), target).key == keys[0]
    assert built[-1]["sources"] == ["gemm_program.cuh", "main.cu", "units_0.cu", "units_1.cu"]
    col = Program(Gemm(True), (Pointwise(E.add(X, E.param(0))),), ("col",))
    assert (build.build_gemm(col, torch.bfloat16, (torch.bfloat16,), target).key
            != build.build_gemm(col, torch.bfloat16, (torch.float32,), target).key)
    other_menu = build.build_gemm(plain, torch.bfloat16, (), target, kernels=(Kernel(256, 128),))
    assert other_menu.key != keys[0] and built[-1]["sources"] == ["config_0.cu", "gemm_program.cuh", "main.cu"]
    build.cutlass_version.cache_clear()
    version.write_text("#define CUTLASS_MAJOR 4\n#define CUTLASS_MINOR 3\n#define CUTLASS_PATCH 0\n")
    assert build.build_gemm(plain, torch.bfloat16, (), target).key != keys[0]


def test_a_finished_module_holding_the_kernels_asked_for_serves_in_place_of_building_them(tmp_path, monkeypatch,
                                                                                         fake_cutlass):
    """A module is keyed on its kernels, so a process whose calls need fewer kernels than one in
    the cache holds (decode alone, after a run that grew the module for prefill too; a test run
    after a prebuild) would build a module of minutes again: the smallest finished module of the
    same program, dtypes and toolchain holding them all serves instead. A menu that none holds,
    another program's, or a module still unfinished is built."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("FXFUSE_CACHE_DIR", str(cache))
    compiled = []

    def finished_build(key, kind, label, name, entry, sources, target, csrc, cutlass=None, manifest=None):
        entry_dir = cache / key
        if not (entry_dir / "ok").is_file():  # what _cached_build leaves: the manifest in ``ok``
            compiled.append(key)
            entry_dir.mkdir(parents=True)
            (entry_dir / "ok").write_text(json.dumps({**manifest, "library": "lib.so", "kind": kind}))
        return None, 0, entry_dir / "lib.so"

    monkeypatch.setattr(build, "_build_generated", finished_build)
    target = build.Target("cuda", "sm_90a", (), None)
    few, many = gemm_codegen.FEW_ROWS_KERNELS, gemm_codegen.KERNELS
    tree = build.build_gemm(S01_BF16, torch.bfloat16, (), target, kernels=many)
    every = build.build_gemm(S01_BF16, torch.bfloat16, (), target, kernels=many + few)
    assert compiled == [tree.key, every.key]
    decode = build.build_gemm(S01_BF16, torch.bfloat16, (), target, kernels=few[:1])
    assert decode.key == every.key and decode.kernels == many + few and len(compiled) == 2
    assert build.build_gemm(S01_BF16, torch.bfloat16, (), target, kernels=many[1:3]).key == tree.key  # the smaller
    assert build.is_built(S01_BF16.to_string(), torch.bfloat16, target, (), few[2:])
    pdl = (Kernel(256, 128, cluster_m=2, pdl=True),)
    assert not build.is_built(S01_BF16.to_string(), torch.bfloat16, target, (), pdl)
    assert build.build_gemm(S01_BF16, torch.bfloat16, (), target, kernels=pdl).key == compiled[-1] != tree.key
    col = Program(Gemm(True), (Pointwise(E.add(X, E.param(0))),), ("col",))
    assert build.build_gemm(col, torch.bfloat16, (torch.bfloat16,), target, kernels=few[:1]).key == compiled[-1]
    (cache / tree.key / "ok").unlink()  # unfinished (or evicted): the larger one serves
    assert build.build_gemm(S01_BF16, torch.bfloat16, (), target, kernels=many[1:3]).key == every.key
    assert len(compiled) == 4


def test_the_in_gemm_tests_check_each_kernel_on_every_stage_kind_and_other_programs_on_one_or_two(monkeypatch):
    """The GPU tests' GEMM modules: each kernel of the production menu on a program of each stage
    kind (the modules the selection's tests route too), every other program on one kernel for many
    rows and, where it swaps, one for few, in turn, so that between them the other programs run
    every kernel: 136 CUTLASS kernels to build, where every program on every kernel was 287."""
    import test_gemm_batch_norm
    import test_gemm_epilogue
    import test_gemm_group_norm
    from gemm_harness import gemm_jobs

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)  # the float32 cases: TF32 modules
    every_kernel = set(gemm_codegen.KERNELS + gemm_codegen.FEW_ROWS_KERNELS)
    files = [(test_gemm_epilogue.BUILDS, test_gemm_epilogue.EVERY_KERNEL),
             (test_gemm_group_norm.CASES, {("s04", torch.bfloat16), ("s02", torch.bfloat16)}),
             (test_gemm_batch_norm.CASES, {("s07", torch.bfloat16)})]
    for cases, production in files:
        assert {key for key, case in cases.items() if len(case) == 2} == production
        for program, dtype, *menu in cases.values():
            if menu:
                assert len(menu[0]) == 1 + gemm_codegen.swaps(program) and set(menu[0]) <= every_kernel
    checked = {kernel for program, _, *menu in test_gemm_epilogue.BUILDS.values() if menu for kernel in menu[0]}
    assert checked == every_kernel
    jobs = set(gemm_jobs({(file, *key): case for file, (cases, _) in enumerate(files) for key, case in cases.items()}))
    assert sum(job.units() for job in jobs if job.param_dtypes is not None) == 136


def test_a_float32_module_is_generated_and_keyed_alike_whatever_the_processs_tf32_setting(monkeypatch, fake_cutlass):
    """A build worker starts with torch's defaults (TF32 off): the TF32 module its parent asked for
    must come out the same there (its sources and its key), or the worker fails it and the parent
    builds it again alone. Whether a float32 call takes the module is decided per call."""
    target = build.Target("cuda", "sm_90a", (), None)
    made = []
    for allowed in (True, False):
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", allowed)
        program = build.gemm_program(S01_BF16, torch.float32)
        made.append((gemm_codegen.generate(program, torch.float32, (), "fxg_t", "fx_gemm_info_t"),
                     build.gemm_key(program, torch.float32, (), target)))
        assert (gemm_codegen.unsupported_reason(S01_BF16, torch.float32) is None) == allowed
    assert made[0] == made[1]


def test_the_selection_times_each_candidate_alone_for_a_while():
    """A candidate timed right after another runs in the state that one left (the card's clocks
    under its power limit): here the first call after the 1 % slower in-GEMM path runs 10 %
    slower. Timed in blocks, each candidate after settling on its own, the faster row path wins,
    where round-robin samples (every candidate once a round) would pick the slower one."""
    from fxfuse.cuda.timing import blocked_medians

    def card_with_memory():
        last = {"call": None}

        def time_once(call):
            slowed = last["call"] is not None and last["call"] is not call and last["call"]() > 100.0
            last["call"] = call
            return call() * (1.10 if slowed else 1.0)

        return time_once

    calls = {"in-GEMM": lambda: 101.0, "row": lambda: 100.0}
    times = blocked_medians(calls, card_with_memory(), settle_s=0.0)
    assert min(times, key=times.get) == "row"
    round_robin, time_once = {name: [] for name in calls}, card_with_memory()
    for _ in range(8):
        for name, call in calls.items():
            round_robin[name].append(time_once(call))
    assert min(round_robin, key=lambda name: sorted(round_robin[name])[4]) == "in-GEMM"


def test_a_configuration_whose_output_disagrees_with_the_row_pass_is_never_timed():
    """Before timing, each GEMM configuration runs once on the measurement's inputs beside the row
    pass: one whose output lies further from the row pass's than a few 16-bit ulps of its largest
    magnitude (a kernel fault: a wrong index, an element not written), or has NaN or infinities
    elsewhere, is left out with a warning, so the selection never chooses it."""
    from fxfuse.cuda.engine import Engine, disagreement

    g = torch.Generator().manual_seed(0)
    row = torch.randn(64, 136, generator=g).to(torch.bfloat16)
    rounded_elsewhere = (row.float() * (1 + 2.0 ** -8)).to(torch.bfloat16)  # an ulp or so apart
    not_written = row.clone()
    not_written[40:, 128:] = 0.0
    nan_elsewhere = row.clone()
    nan_elsewhere[3, 5] = float("nan")
    assert disagreement(rounded_elsewhere, row) is None
    assert "elements" in disagreement(not_written, row)
    assert "(3, 5): nan" in disagreement(nan_elsewhere, row)
    with_nan = row.clone()
    with_nan[3, 5], with_nan[4, 4] = float("nan"), float("inf")
    assert disagreement(with_nan.clone(), with_nan) is None  # the same NaN and infinite positions

    engine = Engine(lambda device: None)
    calls = {"row": lambda: (row, None), "cooperative, raster M": lambda: (rounded_elsewhere, None),
             "pingpong, raster M": lambda: (not_written, None), "cooperative, raster N": lambda: None}
    with pytest.warns(RuntimeWarning, match="2 in-GEMM configurations of .* disagree with the row pass"):
        kept = engine._agreeing(Program.parse("linear(bias=True) | pointwise(x)"), calls)
    assert list(kept) == ["row", "cooperative, raster M"]


def test_a_short_run_settles_for_ten_runs_time_not_the_whole_settling_time(monkeypatch):
    """A candidate whose run takes less than HEAVY_RUN_S (a decode size's microseconds, the tests'
    shapes) does not heat the card: it settles for about ten of its runs, so a selection of forty
    small candidates stays quick. (On a simulated clock: a loaded host's sleep of a quarter of
    HEAVY_RUN_S can overrun it and so settle for the whole minute.)"""
    from types import SimpleNamespace

    from fxfuse.cuda import timing

    clock, runs = [0.0], []
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    def time_once(call):
        clock[0] += timing.HEAVY_RUN_S / 4
        runs.append(call())
        return 1.0

    timing.blocked_medians({"row": lambda: "row"}, time_once, samples_per_block=1, passes=1, settle_s=60.0,
                           warm_up_s=0.0)
    assert 10 <= len(runs) <= 12  # the first untimed run, more to ten runs' time, one sample


def test_a_heavy_run_settles_for_the_whole_settling_time():
    """A candidate whose run takes HEAVY_RUN_S or more (a big GEMM's CUDA-graph replay) keeps the
    card at its power limit: it runs alone for all of ``settle_s`` before its samples, so that they
    read the clocks its own power draw settles on, not those of the candidate before it."""
    import time

    from fxfuse.cuda.timing import HEAVY_RUN_S, blocked_medians

    runs = []

    def time_once(call):
        time.sleep(HEAVY_RUN_S * 2)
        runs.append(call())
        return 1.0

    started = time.perf_counter()
    blocked_medians({"in-GEMM": lambda: "in-GEMM"}, time_once, samples_per_block=1, passes=1, settle_s=0.2,
                    warm_up_s=0.0)
    assert time.perf_counter() - started >= 0.2 and len(runs) > 13


def test_the_selection_samples_the_card_after_its_clocks_have_settled():
    """A card that sat idle runs its first timings on boosted clocks (10 % faster here). The
    candidate timed first, Inductor, would take those and win against a 1 % faster in-GEMM path;
    after the warm-up, which the boosted timings fall in, the faster path wins."""
    from fxfuse.cuda.timing import blocked_medians

    def idle_card():
        timings = {"n": 0}

        def time_once(call):
            timings["n"] += 1
            return call() * (0.9 if timings["n"] <= 6 else 1.0)

        return time_once

    calls = {"Inductor": lambda: 100.0, "in-GEMM": lambda: 99.0}
    times = blocked_medians(calls, idle_card(), settle_s=0.0)
    assert min(times, key=times.get) == "in-GEMM"
    cold = blocked_medians(calls, idle_card(), settle_s=0.0, warm_up_s=0.0)
    assert min(cold, key=cold.get) == "Inductor"  # what timing from the first call picks


def test_the_warm_up_of_short_candidates_ends_after_a_bounded_number_of_runs():
    """Candidates of microseconds (decode sizes, the tests' shapes), which do not heat the card,
    warm up for a bounded number of runs in turn, not for the whole warm-up time; slow ones for
    about the warm-up time."""
    import time

    from fxfuse.cuda.timing import WARM_UP_RUNS, warm_up

    runs = []
    warm_up([lambda: runs.append("in-GEMM"), lambda: runs.append("row")], seconds=60.0)
    assert runs == ["in-GEMM", "row"] * (WARM_UP_RUNS // 2)
    slow = []
    started = time.perf_counter()
    warm_up([lambda: (time.sleep(0.01), slow.append(1))], seconds=0.05)
    assert 5 <= len(slow) <= 7 and time.perf_counter() - started < 1.0


def test_the_selection_spreads_a_drifting_clock_over_all_candidates():
    """A card that slows as it heats (0.5 % a timing here) slows every candidate alike: blocks run
    in order, then in reverse order, so the 1 % faster path wins in either order, where timing
    one candidate after the other once would not."""
    from fxfuse.cuda.timing import blocked_medians

    def drifting_clock():
        timings = {"n": 0}

        def time_once(call):
            timings["n"] += 1
            return call() * (1 + 0.005 * timings["n"])

        return time_once

    for order in (("row", "in-GEMM"), ("in-GEMM", "row")):
        calls = {name: (lambda v=100.0 if name == "row" else 99.0: v) for name in order}
        times = blocked_medians(calls, drifting_clock(), settle_s=0.0)
        assert min(times, key=times.get) == "in-GEMM"
    one_after_the_other = drifting_clock()
    row = sorted(one_after_the_other(lambda: 100.0) for _ in range(8))[4]
    in_gemm = sorted(one_after_the_other(lambda: 99.0) for _ in range(8))[4]
    assert in_gemm > row  # the drift alone would have picked the slower path


def test_inductors_kernels_for_a_chain_compute_the_reference():
    """The selection's Inductor candidate: the chain's eager reference compiled by Inductor on its
    own (here on the CPU), the same values as the reference on the same inputs."""
    from fxfuse import reference
    from fxfuse.cuda.engine import inductor_chain

    program = Program.parse("linear(bias=True) | pointwise(silu(x) * p0 + p1) || full col")
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(48, 32, generator=g), torch.randn(40, 32, generator=g), torch.randn(40, generator=g)
    params = [torch.randn(48, 40, generator=g), torch.randn(40, generator=g)]
    with torch.no_grad():
        out = inductor_chain(program, x, w, b, params)()
    torch.testing.assert_close(out, reference.op_forward(program, x, w, b, params, False)[0])
    no_bias = Program.parse("linear(bias=False) | pointwise(relu(x))")
    with torch.no_grad():
        torch.testing.assert_close(inductor_chain(no_bias, x, w, None, [])(), torch.relu(x @ w.t()))


def test_a_selection_names_whether_inductor_was_faster():
    from fxfuse.cuda.engine import INDUCTOR

    assert Selection("row", -1, {"row": 12.5}, GRAPH_TIMING).inductor_is_faster() is None
    assert Selection("row", -1, {"row": 12.5, INDUCTOR: 13.0}, GRAPH_TIMING).inductor_is_faster() is False
    assert Selection("row", -1, {"row": 12.5, INDUCTOR: 12.6}, GRAPH_TIMING).inductor_is_faster() is True  # within the margin
    faster = Selection("cfg", 0, {"row": 12.5, "cfg": 11.0, INDUCTOR: 10.0}, GRAPH_TIMING)
    assert faster.inductor_is_faster() is True and "Inductor 10.0 us" in faster.describe()


def test_a_program_without_a_gemm_module_is_timed_row_path_against_inductor_and_kept_on_disk(
        tmp_path, monkeypatch):
    """Where no in-GEMM kernel takes a chain, the default policy's selection still times the row
    path against Inductor's kernels (keyed on the row module, nothing routed); not asked to time
    Inductor, there is nothing to choose."""
    import sys
    from types import SimpleNamespace

    from fxfuse.cuda.engine import INDUCTOR, Engine

    engine_module = sys.modules["fxfuse.cuda.engine"]  # fxfuse.cuda.engine is the GPU's Engine

    monkeypatch.setenv("FXFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    program = PROGRAMS["reduce_sum_keep"]
    key = (program.to_string(), torch.float32, 0)
    runs, routed, timed = [], [], []

    engine = Engine(lambda device: None)
    engine._runtime_module = SimpleNamespace(
        bucket_of=lambda m: m, run=lambda *args: runs.append(args[6:]) or "row output",
        choose=lambda *args: routed.append(args))
    engine._handles[key], engine._modules[key] = 7, SimpleNamespace(key="row module key")
    monkeypatch.setattr(engine, "prepare_gemm", lambda *args: None)
    monkeypatch.setattr(engine_module, "inductor_chain", lambda *args: lambda: "inductor output")

    def time_candidates(calls):
        timed.append(sorted(calls))
        return {name: (9.0 if name == INDUCTOR else 10.0) for name, call in calls.items() if call()}, GRAPH_TIMING

    monkeypatch.setattr(engine_module, "time_candidates", time_candidates)
    device = torch.device("cuda", 0)
    args = (program, torch.float32, (torch.float32,), (64, 128, 32), device, True)
    operands = (torch.randn(64, 32), torch.randn(128, 32), torch.randn(128), [torch.tensor(2.0)])
    selection = engine.select(*args, against_inductor=True, operands=operands)
    assert selection == Selection("row", -1, {"row": 10.0, INDUCTOR: 9.0}, GRAPH_TIMING)
    assert selection.inductor_is_faster() and timed == [[INDUCTOR, "row"]]
    assert runs == [(False, 0, -1)] and routed == []  # the row path: no GEMM module, nothing routed
    engine.selections.clear()
    assert engine.select(*args, against_inductor=True, operands=operands) == selection and len(timed) == 1  # disk
    assert engine.select(*args) is None and len(timed) == 1  # policy "always": the row path, untimed


def test_an_in_gemm_winner_is_timed_again_alone_against_the_row_path_and_inductor(tmp_path, monkeypatch):
    """The screen's blocks are short (some fifty candidates), and a CUTLASS kernel, which draws
    more power than cuBLAS's, reads faster there than when it runs alone: where an in-GEMM
    configuration wins the screen, it, the row path and Inductor's kernels are timed again, each
    alone for FINAL_SETTLE_S after the screen's warm-up. The chain takes the faster of fxfuse's two
    finalists, routed so, and is held against Inductor by the final's times."""
    import sys
    from types import SimpleNamespace

    from fxfuse.cuda.engine import FINAL_SETTLE_S, INDUCTOR, ROW_PATH, Engine

    engine_module = sys.modules["fxfuse.cuda.engine"]
    monkeypatch.setenv("FXFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    program = PROGRAMS["s01_scale_leaky"]
    key = (program.to_string(), torch.bfloat16, 0)
    screen = {INDUCTOR: 105.0, ROW_PATH: 104.0, "cooperative": 99.0, "pingpong": 97.0}
    finals = {"loses alone": {INDUCTOR: 100.5, ROW_PATH: 101.0, "pingpong": 103.0},
              "wins alone": {INDUCTOR: 105.0, ROW_PATH: 104.0, "pingpong": 95.0}}
    timed, routed = [], []

    def time_candidates(calls, settle_s=0.05, passes=2, warm_up_s=2.0):
        timed.append((sorted(calls), settle_s, warm_up_s))
        return (finals[case] if settle_s == FINAL_SETTLE_S else screen), GRAPH_TIMING

    monkeypatch.setattr(engine_module, "time_candidates", time_candidates)
    monkeypatch.setattr(engine_module, "inductor_chain", lambda *args: lambda: None)
    kernels = (gemm_codegen.KERNELS[0], gemm_codegen.KERNELS[2])  # one configuration each
    module = SimpleNamespace(key="gemm module key", config_names=("cooperative", "pingpong"), info=0,
                             kernels=kernels, kernel_of=kernels.__getitem__, supports=lambda m, n, k, config: True)
    out = torch.zeros(4, 8)
    operands = (torch.randn(64, 32), torch.randn(128, 32), torch.randn(128), [])
    for case, path, to_inductor in (("loses alone", ROW_PATH, True), ("wins alone", "pingpong", False)):
        engine = Engine(lambda device: None)
        engine._runtime_module = SimpleNamespace(bucket_of=lambda m: m, run=lambda *args: (out, None),
                                                 choose=lambda *args: routed.append(args[-1]))
        engine._handles[key] = 7
        monkeypatch.setattr(engine, "prepare_gemm", lambda *args, module=module: module)
        monkeypatch.setenv("FXFUSE_CACHE_DIR", str(tmp_path / case))
        selection = engine.select(program, torch.bfloat16, (), (64, 128, 32), torch.device("cuda", 0), True,
                                  against_inductor=True, operands=operands)
        assert timed[-1] == ([INDUCTOR, "pingpong", ROW_PATH], FINAL_SETTLE_S, 0.0)  # after the screen's warm-up
        assert selection.path == path and routed[-1] == selection.config == (-1 if path == ROW_PATH else 1)
        assert selection.times_us == screen and selection.final_us == finals[case]
        assert selection.inductor_is_faster() is to_inductor
        assert f"then each alone for {FINAL_SETTLE_S} s" in selection.describe()


def test_the_sanitizers_in_gemm_calls_are_programs_the_generator_takes():
    """compute-sanitizer's run (tests/gpu/sanitize.py) covers each kind of in-GEMM epilogue; a call
    the generator declined would leave its kind unchecked, so each one generates here."""
    import sanitize
    from gemm_harness import param_dtypes

    for name, dtype, *_ in sanitize.GEMM_CALLS:
        program = sanitize.PROGRAMS[name]
        assert gemm_codegen.unsupported_reason(program, dtype) is None, name
        assert "config_0.cu" in gemm_codegen.generate(gemm_codegen.canonical(program), dtype,
                                                      param_dtypes(program, dtype), "ns", "e")


def test_a_call_in_a_bucket_no_selection_timed_is_timed_once_on_its_own_operands_without_a_build(
        tmp_path, monkeypatch):
    """A graph Dynamo traced with a symbolic batch serves every size with the routes timed at its
    traced size. The runtime hands the first call in another bucket of M to the engine, which times
    the row path and the module it holds (building none for these rows) on that call's operands and
    routes the bucket; a measurement that fails routes it to the row path, with a warning; while a
    CUDA graph is captured nothing is timed or routed (a later call measures)."""
    import sys
    from types import SimpleNamespace

    from fxfuse.cuda.engine import DTYPE_CODES, ROW_PATH, Engine

    engine_module = sys.modules["fxfuse.cuda.engine"]
    monkeypatch.setenv("FXFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    program = PROGRAMS["s01_scale_leaky"]
    text, bf16 = program.to_string(), torch.bfloat16
    kernels = (gemm_codegen.KERNELS[0], gemm_codegen.KERNELS[2])  # one configuration each
    module = SimpleNamespace(key="gemm module key", config_names=("cooperative", "pingpong"), info=0,
                             kernels=kernels, kernel_of=kernels.__getitem__, supports=lambda m, n, k, config: True)
    x, w, b = torch.randn(2, 150, 32).to(bf16), torch.randn(128, 32).to(bf16), torch.randn(128).to(bf16)
    out = torch.zeros(300, 128)
    screen = {ROW_PATH: 104.0, "cooperative": 99.0, "pingpong": 97.0}
    runs, timed, routed = [], [], []

    def time_candidates(calls, settle_s=0.05, passes=2, warm_up_s=2.0):
        timed.append(sorted(calls))
        return screen, GRAPH_TIMING

    def measuring_engine() -> Engine:
        engine = Engine(lambda device: None)
        engine._runtime_module = SimpleNamespace(
            bucket_of=lambda m: (m - 1).bit_length(), run=lambda *args: runs.append(args[1]) or (out, None),
            choose=lambda *args: routed.append(args))
        key = (text, bf16, -1)
        engine._handles[key], engine._gemms[(key, ())] = 7, module
        monkeypatch.setattr(engine, "prepare_gemm", lambda *args: pytest.fail("a module built at a call"))
        return engine

    monkeypatch.setattr(engine_module, "time_candidates", time_candidates)
    engine = measuring_engine()
    engine.measure_call(text, x, w, b, [])
    assert timed[0] == sorted(screen) and all(run.data_ptr() == x.data_ptr() for run in runs)  # the call's x
    assert routed == [(text, DTYPE_CODES[bf16], -1, 300, 128, 32, 1)]  # the bucket of 300 rows: pingpong's
    assert engine.selections[((text, bf16, -1), (), 128, 32, 9, False, False)].path == "pingpong"
    # a compile traced in that bucket later times it again, on the module it builds for those rows
    grown = SimpleNamespace(**{**vars(module), "key": "grown module key"})
    monkeypatch.setattr(engine, "prepare_gemm", lambda *args: grown)
    at_call = len(timed)  # the screen and the final of the timing at the call
    engine.select(program, bf16, (), (300, 128, 32), torch.device("cpu"), True)
    assert len(timed) == 2 * at_call
    engine.select(program, bf16, (), (300, 128, 32), torch.device("cpu"), True)
    assert len(timed) == 2 * at_call  # held from then on

    def failing(calls, settle_s=0.05, passes=2, warm_up_s=2.0):
        raise RuntimeError("no timing here")

    monkeypatch.setattr(engine_module, "time_candidates", failing)
    monkeypatch.setenv("FXFUSE_CACHE_DIR", str(tmp_path / "empty"))
    routed.clear()
    with pytest.warns(RuntimeWarning, match="at 300 rows could not be timed .* they take the row path"):
        measuring_engine().measure_call(text, x, w, b, [])
    assert routed == [(text, DTYPE_CODES[bf16], -1, 300, 128, 32, -1)]

    routed.clear()
    float32_params = [torch.ones(128)]  # parameters of other dtypes than the module's: no module to time
    measuring_engine().measure_call(text, x, w, b, float32_params)
    assert routed == [(text, DTYPE_CODES[bf16], -1, 300, 128, 32, -1)]

    monkeypatch.setattr(engine_module, "_capturing", lambda device: True)
    routed.clear()
    measuring_engine().measure_call(text, x, w, b, [])
    assert routed == []
