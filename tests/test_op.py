"""The fused op as a torch.library citizen: opcheck, fake shapes, autograd, the IR's string form."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from examples import suite
from fxfuse import expr as E
from fxfuse import reference
from fxfuse.ir import Gemm, Norm, Pointwise, Program, Reduce
from fxfuse.vocabulary import call
from support import compile_fxfuse

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))  # the shared program table
from programs import PROGRAMS, make_params  # noqa: E402

BASE_ROWS = [r for r in suite.ROWS if not r.id.startswith("S23")]


def _recorded_calls(row, dtype=torch.float32):
    """(program, x, weight, bias, params) of every fused-op call of a compiled suite model."""
    calls = []
    op_forward = reference.op_forward

    def recording_op_forward(program, x, weight, bias, params, save_gemm):
        calls.append((program.to_string(), x.clone(), weight.clone(), None if bias is None else bias.clone(),
                      [p.clone() for p in params]))
        return op_forward(program, x, weight, bias, params, save_gemm)

    mod = suite.load(row)
    model = mod.Model(*mod.get_init_inputs("small")).to(dtype).train(not row.eval_mode)
    reference.op_forward = recording_op_forward
    try:
        with torch.no_grad():
            compile_fxfuse(model)(*[t.to(dtype) for t in mod.get_inputs("small")])
    finally:
        reference.op_forward = op_forward
    return calls


@pytest.mark.parametrize("row", BASE_ROWS, ids=[r.id for r in BASE_ROWS])
def test_every_suite_program_passes_opcheck(row):
    calls = _recorded_calls(row)
    assert calls
    for program, x, weight, bias, params in calls:
        constant = Program.parse(program).constant_params  # running statistics: never differentiable
        params = [p.requires_grad_(i not in constant) for i, p in enumerate(params)]
        args = (program, x.requires_grad_(), weight.requires_grad_(),
                None if bias is None else bias.requires_grad_(), params)
        for save_gemm in (True, False):  # a training graph's call; a direct call recomputes the GEMM
            torch.library.opcheck(torch.ops.fxfuse.linear_epilogue.default, (*args, save_gemm))


@pytest.mark.parametrize("name", [n for n in PROGRAMS if n.startswith("widen_")])
def test_a_chain_that_widens_returns_float32_and_passes_opcheck(name):
    """bfloat16 x, weight and bias, float32 parameters (autocast's): a float32 output, from the
    real kernel and the fake one, with gradients of every input."""
    program = PROGRAMS[name]
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(s, generator=g).to(torch.bfloat16) for s in [(6, 8), (16, 8), (16,)])
    params = [p.requires_grad_(i not in program.constant_params)
              for i, p in enumerate(make_params(program, 16, generator=g, lead=(6,)))]
    args = (program.to_string(), x.requires_grad_(), w.requires_grad_(), b.requires_grad_(), params)
    out, *_ = torch.ops.fxfuse.linear_epilogue(*args, False)
    assert out.dtype == torch.float32
    for save_gemm in (True, False):
        torch.library.opcheck(torch.ops.fxfuse.linear_epilogue.default, (*args, save_gemm))


def test_fake_impl_gives_shapes_for_symbolic_batch():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    program = Program(Gemm(True), (Pointwise(call("relu", E.X)), Reduce("sum", keepdim=True)))
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        x = mode.from_tensor(torch.randn(8, 3, 16), symbolic_context=None)
        out, stats, _, _ = torch.ops.fxfuse.linear_epilogue(program.to_string(), x, torch.randn(32, 16),
                                                         torch.randn(32), [], False)
    assert tuple(out.shape) == (8, 3, 1) and stats.shape == (0,)


def test_batch_norm_training_returns_mean_and_unbiased_variance():
    program = Program(Gemm(False), (Norm("batch", 1e-5, training=True),))
    x, w = torch.randn(16, 8), torch.randn(4, 8)
    _, stats, *_ = torch.ops.fxfuse.linear_epilogue(program.to_string(), x, w, None, [], False)
    var, mean = torch.var_mean(x @ w.T, dim=0, correction=1)
    torch.testing.assert_close(stats, torch.stack([mean, var]))


def test_program_string_form_round_trips_and_keeps_the_users_arithmetic():
    expr = E.div(E.add(E.X, E.X), E.const(10.0))
    expr = E.sub(call("leaky_relu", expr, E.const(0.1)), E.mul(E.X, call("sigmoid", E.X)))
    program = Program(
        Gemm(True),
        (Pointwise(expr), Norm("group", 1e-5, groups=4, weight=0, bias=1),
         Reduce("logsumexp", keepdim=True), Pointwise(E.neg(call("clamp", E.X, E.const(-float("inf")), E.const(2.0))))),
        ("col", "col"),
    )
    text = program.to_string()
    assert "leaky_relu((x + x) / 10.0, 0.1) - (x * sigmoid(x))" in text  # no folding to 0.2*x
    assert Program.parse(text) == program and Program.parse(text).to_string() == text


def test_x_minus_x_is_not_folded_so_inf_gives_nan():
    program = Program(Gemm(False), (Pointwise(E.sub(E.X, E.X)),))
    x = torch.tensor([[1.0, 0.0]])
    w = torch.tensor([[float("inf"), 0.0], [1.0, 0.0]])
    out, *_ = torch.ops.fxfuse.linear_epilogue(program.to_string(), x, w, None, [], False)
    assert out[0, 0].isnan() and out[0, 1] == 0


@pytest.mark.parametrize("save_gemm", [True, False], ids=["gemm_saved", "gemm_recomputed"])
def test_backward_matches_autograd_through_the_reference(save_gemm):
    program = Program(Gemm(True), (Pointwise(E.mul(call("gelu", E.X), E.param(0))),
                                   Norm("layer", 1e-5), Reduce("softmax")), ("col",))
    x, w, b, p = (torch.randn(s, requires_grad=True) for s in [(6, 8), (5, 8), (5,), (5,)])
    out, _, gemm, _ = torch.ops.fxfuse.linear_epilogue(program.to_string(), x, w, b, [p], save_gemm)
    assert gemm.shape == ((6, 5) if save_gemm else (0,))
    expected, _ = reference.forward(program, x, w, b, [p])
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, w, b, p], g)
    expected_grads = torch.autograd.grad(expected, [x, w, b, p], g)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want)


def test_training_graph_saves_the_gemm_output_and_runs_two_gemms_backward():
    """The backward starts from the GEMM output the forward kept: the backward graph holds the two
    GEMMs of dX and dW and no third one recomputing the forward GEMM."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_function

    program = Program(Gemm(True), (Pointwise(call("gelu", E.X)), Norm("layer", 1e-5)))
    graphs = {}

    def keep(name):
        def compiler(gm, _):
            graphs[name] = gm
            return make_boxed_func(gm.forward)
        return compiler

    def f(x, w, b):
        return torch.ops.fxfuse.linear_epilogue(program.to_string(), x, w, b, [], True)[0]

    x, w, b = (torch.randn(s, requires_grad=True) for s in [(6, 8), (5, 8), (5,)])
    aot_function(f, fw_compiler=keep("forward"), bw_compiler=keep("backward"))(x, w, b).sum().backward()
    backward_targets = [n.target for n in graphs["backward"].graph.nodes if n.op == "call_function"]
    gemms = [t for t in backward_targets if t in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)]
    assert len(gemms) == 2 and torch.ops.fxfuse.linear_epilogue.default not in backward_targets
    expected = torch.autograd.grad(reference.forward(program, x, w, b, [])[0].sum(), [x, w, b])
    for got, want in zip((x.grad, w.grad, b.grad), expected):
        torch.testing.assert_close(got, want)
