"""GroupNorm inside the GEMM's epilogue (fxg::GroupNorm) on a Hopper GPU.

Where a group's columns lie inside the epilogue subtile (8, 16, 32 or 64 columns), the statistics
of each (row, group) are taken in registers from the float32 accumulators and the chain after the
norm runs before the one store. Each kernel of the production menu computes S04's and S02's
group-norm chains, and a kernel or two of it in turn each other chain, under the correctness rule
at every such group size, odd M, bfloat16 and float16, NaN/Inf rows;
group sizes the subtile cannot hold, and 3-D inputs (torch takes their dim 1 as channels), are not
covered by the module and take the row path.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import fxfuse.cuda as fxcuda
from fxfuse.cuda.gemm_codegen import FEW_ROWS_KERNELS, KERNELS
from fxfuse import reference
from fxfuse.ir import Gemm, Norm, Pointwise, Program
from gemm_harness import (Modules, assert_every_kernel_computes, assert_under_rule, draw, every_schedule, kernels,
                          names_of, on_checking_menus, run_config, truth)
from programs import PROGRAMS
from fxfuse import expr as E
from fxfuse.vocabulary import call

GROUPS = 33  # N = 33 x group size: odd numbers of tiles and of groups a tile


def with_groups(program: Program, groups: int) -> Program:
    stages = tuple(dataclasses.replace(s, groups=groups) if isinstance(s, Norm) else s for s in program.stages)
    return Program(program.gemm, stages, program.params)


PROGRAMS_33 = {
    "s02": with_groups(PROGRAMS["s02_group_leaky_double"], GROUPS),
    "s04": with_groups(PROGRAMS["s04_group_silu_vec_silu"], GROUPS),
    "s17": with_groups(PROGRAMS["s17_vec_hardtanh_mish_group"], GROUPS),
    "s08_widen": with_groups(PROGRAMS["widen_s08_silu_vec_group"], GROUPS),
    "plain_no_bias": Program(Gemm(False), (Norm("group", 1e-3, groups=GROUPS),)),
    "scalar_after": Program(Gemm(True), (Norm("group", 1e-5, groups=GROUPS, weight=0),
                                         Pointwise(call("tanh", E.mul(E.X, E.param(1))))), ("col", "scalar")),
}
# S04 and S02 on the production menu, each kernel checked; the others on a kernel or two in turn
# (gemm_harness.checking_menu)
CASES = on_checking_menus({**{(name, torch.bfloat16): (p, torch.bfloat16) for name, p in PROGRAMS_33.items()},
                           ("s04", torch.float16): (PROGRAMS_33["s04"], torch.float16)},
                          {("s04", torch.bfloat16), ("s02", torch.bfloat16)})
GROUP_SIZES = [8, 16, 32, 64]
SHAPES = [(1, 72), (7, 264), (300, 520), (1024, 512)]  # (M, K)


@pytest.fixture(scope="module")
def modules(request):
    return Modules(request, CASES)


@pytest.mark.parametrize("group", GROUP_SIZES)
@pytest.mark.parametrize("name,dtype", list(CASES))
def test_every_kernel_normalizes_every_group_size_inside_the_tile(modules, name, dtype, group):
    for m, k in SHAPES:
        assert_every_kernel_computes(modules[(name, dtype)], PROGRAMS_33[name], dtype, m, GROUPS * group, k,
                                     seeds=3 if m < 1024 else 1)


def test_every_schedule(modules):
    program, module = PROGRAMS_33["s04"], modules[("s04", torch.bfloat16)]
    x, w, b, params = draw(program, torch.bfloat16, 111, GROUPS * 16, 136, seed=3)
    eager = reference.op_forward(program, x, w, b, params, False)[0]
    exact = truth(program, x, w, b, params)
    for config in every_schedule(module, 111, GROUPS * 16, 136):
        assert_under_rule(run_config(module, program, x, w, b, params, config), eager, exact)


def test_a_three_dimensional_input_is_not_the_modules(modules):
    """torch's group norm takes dim 1 of a 3-D value as its channels, not the GEMM's features: the
    module covers 2-D x only (as the row kernels), and the call computes what eager computes (here
    eager's error: 37 channels in 33 groups)."""
    program, module = PROGRAMS_33["s04"], modules[("s04", torch.bfloat16)]
    x, w, b, params = draw(program, torch.bfloat16, 37, GROUPS * 16, 136, seed=3, batch=(3,))
    assert fxcuda.engine.forward_kernels(program.to_string(), x, w, b, params, gemm=module, config=0) is None
    with pytest.raises(RuntimeError):
        fxcuda.engine.call(program.to_string(), x, w, b, params, gemm=module, config=0)


def test_a_row_of_nan_or_inf_spoils_only_its_own_groups(modules):
    program, module = PROGRAMS_33["s02"], modules[("s02", torch.bfloat16)]
    x, w, b, params = draw(program, torch.bfloat16, 64, GROUPS * 32, 72, seed=5)
    x[3, 5] = math.nan
    x[7, :] = math.inf
    w[40, 0] = math.inf  # one column: its group in every row
    eager = reference.op_forward(program, x, w, b, params, False)[0]
    for config in kernels(module):
        out = run_config(module, program, x, w, b, params, config)
        assert torch.equal(out.isnan(), eager.isnan())
        finite = eager.isfinite()
        assert_under_rule(out[finite], eager[finite], truth(program, x, w, b, params)[finite])


@pytest.mark.parametrize("n", [GROUPS * 128, GROUPS * 4, GROUPS * 24, GROUPS * 8 + 8])
def test_groups_the_subtile_cannot_hold_are_not_covered_and_take_the_row_path(modules, n):
    """128 columns (wider than the subtile), 4 (not whole 8-column blocks), 24 (not dividing the
    subtile), N not a multiple of the groups: no configuration covers them; the op still computes
    the program."""
    program, module = PROGRAMS_33["s02"], modules[("s02", torch.bfloat16)]
    assert not any(module.supports(64, n, 72, c) for c in range(len(module.config_names)))
    if n % GROUPS:
        return
    x, w, b, params = draw(program, torch.bfloat16, 64, n, 72, seed=1)
    out = torch.ops.fxfuse.linear_epilogue(program.to_string(), x, w, b, params, False)[0]
    torch.testing.assert_close(out, reference.op_forward(program, x, w, b, params, False)[0], atol=1e-2, rtol=1e-2)


def test_the_selection_measures_the_in_gemm_group_norm(modules):
    """At 1024 rows the kernels for many rows are timed beside the row path, at 16 the swapped
    kernel of the 16-wide tile."""
    program, module = PROGRAMS_33["s04"], modules[("s04", torch.bfloat16)]
    few = fxcuda.select(program, torch.bfloat16, (torch.bfloat16,) * 3, (16, GROUPS * 32, 512), True)
    assert set(few.times_us) == {"row", *names_of(module, FEW_ROWS_KERNELS[:1])}
    selection = fxcuda.select(program, torch.bfloat16, (torch.bfloat16,) * 3, (1024, GROUPS * 32, 512), True)
    assert set(selection.times_us) == {"row", *names_of(module, KERNELS)}
    x, w, b, params = draw(program, torch.bfloat16, 1000, GROUPS * 32, 512, seed=2)
    out = torch.ops.fxfuse.linear_epilogue(program.to_string(), x, w, b, params, False)[0]
    assert_under_rule(out, reference.op_forward(program, x, w, b, params, False)[0], truth(program, x, w, b, params))


def test_a_training_forward_takes_the_row_path_and_says_why():
    """A forward autograd records keeps the GEMM output for the backward; the in-GEMM epilogue
    does not store it, so the chain runs cuBLAS + the row pass, the report says so, and no in-GEMM
    configuration is measured for it."""
    import fxfuse
    from examples import suite

    model, inputs = suite.build("S08", size="small", device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(model.train(), backend="fxfuse", options={"policy": "always"})
    compiled(*inputs).sum().backward()
    (row,) = fxfuse.last_report().rows
    assert row.status == "fused" and row.path.startswith("cuBLAS + row pass (the forward keeps the GEMM output")
