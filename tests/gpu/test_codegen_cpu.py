"""The CUDA code generator without a compiler: literals, the expression printer, program checks.

The printed C is also executed here by translating each statement into float32 torch arithmetic
(the same IEEE single-precision operations the kernel performs, libm calls aside) and compared with
fxfuse.expr.evaluate as the reference runs it.
"""

from __future__ import annotations

import math
import re
import struct

import pytest
import torch

from fxfuse import expr as E
from fxfuse.cuda import codegen
from fxfuse.cuda.printer import float32, float_literal, print_expr
from fxfuse.ir import Gemm, Norm, Pointwise, Program, Reduce, Widen
from fxfuse.vocabulary import POINTWISE, call

X, p, c = E.X, E.param, E.const


# -- literals ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value,text",
    [(2.0, "2.0f"), (1.5, "1.5f"), (-2.5, "(-2.5f)"), (-0.0, "(-0.0f)"), (0.1, "0.10000000149011612f"),
     (1e-05, "9.999999747378752e-06f"), (math.inf, "INFINITY"), (-math.inf, "(-INFINITY)"), (math.nan, "NAN"),
     (1e300, "INFINITY"), (-1e300, "(-INFINITY)"), (1e-50, "0.0f"), (3.4028234663852886e38, "3.4028234663852886e+38f")],
)
def test_float_literal(value, text):
    assert float_literal(value) == text


@pytest.mark.parametrize("value", [0.1, 1 / 3, 2.0 / 7.0, 1e-7, 123456.789, 6.02e23, 1.17549435e-38, 1e-45])
def test_float_literal_round_trips_to_float32(value):
    literal = float_literal(value).strip("()").rstrip("f")
    assert struct.pack("f", float(literal)) == struct.pack("f", value)


# -- the printer ------------------------------------------------------------------------------------


def lines_of(expression):
    printed = print_expr(expression)
    return printed, "\n".join(printed.lines)


def test_value_used_twice_is_computed_once():
    printed, text = lines_of(E.mul(X, call("sigmoid", X)))
    assert text.count("fx_sigmoid") == 1
    s04 = E.mul(E.mul(E.mul(X, call("sigmoid", X)), p(2)), call("sigmoid", E.mul(E.mul(X, call("sigmoid", X)), p(2))))
    printed, text = lines_of(s04)
    assert text.count("fx_sigmoid(x)") == 1 and text.count("fx_sigmoid") == 2
    assert printed.params == {2}


def test_division_by_a_constant_multiplies_by_its_float32_reciprocal():
    printed, text = lines_of(E.div(X, c(10.0)))
    recip = float(torch.tensor(1.0) / torch.tensor(10.0))
    assert text == f"const float t0 = x * {float_literal(recip)};"
    _, text = lines_of(E.div(X, E.sub(c(1.0), c(1.0))))  # x / 0.0: x * inf, as torch on CUDA
    assert text == "const float t0 = x * INFINITY;"


def test_constant_over_tensor_is_reciprocal_times_constant():
    printed, text = lines_of(E.div(c(2.0), X))
    assert text.splitlines() == ["const float t0 = 1.0f / x;", "const float t1 = t0 * 2.0f;"]


def test_subtraction_negation_and_order():
    _, text = lines_of(E.sub(E.sub(X, c(2.0)), E.neg(p(0))))
    assert text.splitlines() == ["const float t0 = x - 2.0f;", "const float t1 = -p0;", "const float t2 = t0 - t1;"]


def test_constants_fold_in_double_like_python():
    _, text = lines_of(E.mul(X, E.div(c(1.0), c(3.0))))
    assert text == f"const float t0 = x * {float_literal(1.0 / 3.0)};"
    _, text = lines_of(E.add(E.add(c(0.1), c(0.2)), X))  # (0.1 + 0.2) in double, then rounded
    assert text == f"const float t0 = {float_literal(0.1 + 0.2)} + x;"


@pytest.mark.parametrize(
    "exponent,snippet",
    [(2.0, "x * x"), (3.0, "x * x * x"), (0.5, "sqrtf(x)"), (-1.0, "1.0f / x"), (-2.0, "1.0f / (x * x)"),
     (-0.5, "1.0f / sqrtf(x)"), (1.0, "= x;"), (0.0, "= 1.0f;"), (1.7, "powf(x, 1.7000000476837158f)")],
)
def test_power_special_cases(exponent, snippet):
    _, text = lines_of(E.power(X, c(exponent)))
    assert snippet in text


def test_vocabulary_calls_use_device_functions_and_float_attributes():
    _, text = lines_of(call("softplus", X, c(2.0), c(20.0)))
    assert text == "const float t0 = fx_softplus(x, 2.0f, 20.0f);"
    _, text = lines_of(call("clamp", X, c(-math.inf), c(1.0)))
    assert "fx_clamp(x, (-INFINITY), 1.0f)" in text
    for name, row in POINTWISE.items():
        args = [X] + [p(0)] * (row.operands - 1) + [c(0.5)] * len(row.attrs)
        _, text = lines_of(call(name, *args))
        assert text.startswith(f"const float t0 = {row.device_fn}(x")


# -- executing the printed C as float32 arithmetic ---------------------------------------------------

_FUNCTIONS = {row.device_fn: row for row in POINTWISE.values()}


def run_printed(expression, x: torch.Tensor, params: dict[int, torch.Tensor]) -> torch.Tensor:
    """Evaluate the printer's statements with float32 torch ops, one C operation at a time."""
    printed = print_expr(expression)
    env: dict[str, torch.Tensor] = {"x": x, **{f"p{i}": v for i, v in params.items()}}

    def literal(tok: str) -> torch.Tensor:
        tok = tok.strip("()")
        value = {"INFINITY": math.inf, "-INFINITY": -math.inf, "NAN": math.nan}.get(tok)
        if value is None:
            value = float(tok.rstrip("f"))
        return torch.tensor(value, dtype=torch.float32)

    def value(tok: str) -> torch.Tensor:
        return env[tok] if tok in env else literal(tok)

    def evaluate(text: str) -> torch.Tensor:
        m = re.fullmatch(r"(\w+)\((.*)\)", text)
        if m and m.group(1) in _FUNCTIONS:
            row = _FUNCTIONS[m.group(1)]
            args = [a.strip() for a in m.group(2).split(",")]
            operands = [value(a) for a in args[: row.operands]]
            attrs = [float(literal(a)) for a in args[row.operands :]]
            return row.reference(*operands, *attrs).float()
        if m and m.group(1) in ("powf", "sqrtf"):
            args = [value(a.strip()) for a in m.group(2).split(",")]
            return torch.pow(*args) if m.group(1) == "powf" else torch.sqrt(args[0])
        m = re.fullmatch(r"1\.0f / \((\w+) \* (\w+)\)", text)
        if m:
            return 1.0 / (value(m.group(1)) * value(m.group(2)))
        m = re.fullmatch(r"1\.0f / sqrtf\((\w+)\)", text)
        if m:
            return 1.0 / torch.sqrt(value(m.group(1)))
        if text.startswith("-") and re.fullmatch(r"-\w+", text):
            return -value(text[1:])
        tokens = text.split(" ")
        acc = value(tokens[0])
        for op, tok in zip(tokens[1::2], tokens[2::2]):
            rhs = value(tok)
            acc = {"+": torch.add, "-": torch.sub, "*": torch.mul, "/": torch.div}[op](acc, rhs)
        return acc

    for line in printed.lines:
        name, text = re.fullmatch(r"const float (\w+) = (.*);", line).groups()
        env[name] = evaluate(text)
    return value(printed.result).expand_as(x)


def reference_eval(expression, x, params):
    def symbol(s):
        return x if s == X else params[E.param_index(s)]

    result = E.evaluate(expression, symbol, lambda fn, args: fn.row.reference(*args))
    return result if isinstance(result, torch.Tensor) else torch.full_like(x, result)


EXPRESSIONS = [
    E.mul(X, call("sigmoid", X)),
    call("leaky_relu", E.mul(X, c(2.0)), c(0.1)),
    E.add(call("leaky_relu", X, c(0.01)), call("leaky_relu", X, c(0.01))),
    call("gelu", E.div(X, c(10.0))),
    call("relu", E.mul(E.sub(X, c(2.0)), c(1.5))),
    call("clamp", call("tanh", call("clamp", E.div(E.mul(X, call("sigmoid", X)), c(2.0)), c(-1.0), c(1.0))), c(-1.0), c(1.0)),
    E.div(E.add(X, p(0)), p(1)),
    E.sub(c(3.0), E.div(c(2.0), E.add(call("abs", X), c(1.0)))),
    E.add(E.power(X, c(2.0)), E.power(call("abs", X), c(0.5))),
    E.power(E.add(call("abs", X), c(0.25)), c(-1.5)),
    E.neg(E.mul(call("maximum", X, p(0)), call("minimum", X, p(1)))),
    E.mul(E.mul(X, E.div(c(1.0), c(3.0))), E.add(c(0.1), c(0.2))),
    call("bf16", E.mul(call("bf16", E.mul(X, c(3.0))), p(0))),
    call("fp16", call("silu", X)),
]


@pytest.fixture
def one_thread():
    """torch's CPU kernels on one thread. On a 2-core machine a 4096-element sigmoid is split
    between the caller and a pool thread, and in about one process in four the pool thread's half
    came out up to 4e-5 off the caller's for the same input (the same call twice differed): the
    comparisons below are exact, so both sides must run the same code."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("index", range(len(EXPRESSIONS)))
def test_printed_code_computes_what_the_reference_computes(index, one_thread):
    expression = EXPRESSIONS[index]
    g = torch.Generator().manual_seed(index)
    x = torch.randn(4096, generator=g) * 3
    x[:6] = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-30])
    params = {0: torch.randn(4096, generator=g), 1: torch.randn(4096, generator=g).abs() + 0.1}
    got = run_printed(expression, x, params)
    want = reference_eval(expression, x, params)
    # CUDA divides by a constant as a * (1 / b) (torch's CUDA kernel does too), CPU divides: an ulp
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-30, equal_nan=True)


# -- programs -------------------------------------------------------------------------------------


def test_sources_of_a_program():
    program = Program(Gemm(True), (Norm("group", 1e-5, groups=4, weight=0, bias=1), Pointwise(call("relu", X))), ("col", "col"))
    bf16 = codegen.generate(program, torch.bfloat16, "fxm_a", "fx_entry_a")
    assert sorted(bf16) == ["items_1.cu", "items_2.cu", "items_4.cu", "items_8.cu", "main.cu", "program.cuh"]
    assert "FX_DEFINE_PROGRAM(fxm_a::Prog, __nv_bfloat16, fx_entry_a)" in bf16["main.cu"]
    assert "r.template group_norm<__nv_bfloat16, 4, 0, 1>(9.999999747378752e-06f);" in bf16["program.cuh"]
    assert "using Out = __nv_bfloat16;" in bf16["program.cuh"]
    assert "n % 4 == 0" in bf16["program.cuh"]
    f32 = codegen.generate(program, torch.float32, "fxm_a", "fx_entry_a", ext=".cpp")
    assert "items_16.cpp" in f32 and "#define FX_ITEMS_UNIT" in f32["items_16.cpp"]


def test_batch_norm_training_splits_prefix_and_rest():
    program = Program(Gemm(True), (Pointwise(E.mul(X, p(0))), Norm("batch", 1e-5, weight=1, training=True), Pointwise(call("relu", X))), ("col", "col"))
    header = codegen.generate(program, torch.float32, "fxm_b", "e")["program.cuh"]
    prefix = header[header.index("prefix(R& r)") : header.index("rest(R& r)")]
    rest = header[header.index("rest(R& r)") :]
    assert "col_chunk<0>" in prefix and "batch_norm_train" not in prefix
    assert "batch_norm_train<float, 1, -1>()" in rest and "fx_relu" in rest
    assert "kBatchTrain = true" in header and "kBatchEps = 9.999999747378752e-06f" in header


def test_reduction_then_scalar_pointwise():
    program = Program(Gemm(False), (Reduce("logsumexp", keepdim=False), Pointwise(E.mul(X, p(0)))), ("scalar",))
    header = codegen.generate(program, torch.float32, "fxm_c", "e")["program.cuh"]
    assert "float s = r.reduce_logsumexp();" in header
    assert "scalar_param<0>()" in header and "r.store_scalar(s);" in header
    assert "kOutKind = FX_OUT_REDUCED;" in header


def bf16(expression):
    return call("bf16", expression)


def body_of(header: str, function: str) -> str:
    start = header.index(f"{function}(R& r)")
    return header[start : header.index("\n  }\n", start)]


def test_a_norm_rounds_its_input_only_where_it_is_not_already_a_t_value():
    rounded = Program(Gemm(True), (Pointwise(bf16(E.mul(X, c(2.0)))), Norm("layer", 1e-5)))
    unrounded = Program(Gemm(True), (Pointwise(E.mul(X, c(2.0))), Norm("layer", 1e-5)))
    after_softmax = Program(Gemm(True), (Reduce("softmax"), Norm("layer", 1e-5)))
    gemm_output = Program(Gemm(True), (Norm("layer", 1e-5),))
    rounds = {name: "r.round_input();" in codegen.generate(prog, torch.bfloat16, "n", "e")["program.cuh"]
              for name, prog in [("rounded", rounded), ("unrounded", unrounded), ("after_softmax", after_softmax),
                                 ("gemm_output", gemm_output)]}
    assert rounds == {"rounded": False, "unrounded": True, "after_softmax": True, "gemm_output": False}
    assert "round_input" not in codegen.generate(unrounded, torch.float32, "n", "e")["program.cuh"]


def test_the_batch_norm_input_is_rounded_at_the_end_of_the_prefix():
    program = Program(Gemm(True), (Pointwise(E.mul(X, p(0))), Norm("batch", 1e-5, training=True)), ("col",))
    header = codegen.generate(program, torch.bfloat16, "n", "e")["program.cuh"]
    assert body_of(header, "prefix").rstrip().endswith("r.round_input();")
    assert "round_input" not in body_of(header, "rest")


def test_after_the_chain_widens_nothing_rounds_and_norms_compute_in_float32():
    """bf16(silu(x)) + p0 in float32 (S08 under autocast: a float32 parameter promotes), then a
    float32 group norm: one rounding (silu's), a float norm, a float output; the batch norm before
    the widening (S18) computes for bf16."""
    s08 = Program(Gemm(True), (Pointwise(E.add(bf16(call("silu", X)), p(0))), Widen(), Norm("group", 1e-5, groups=4)), ("col",))
    header = codegen.generate(s08, torch.bfloat16, "n", "e")["program.cuh"]
    rest = body_of(header, "rest")
    assert rest.count("fx_round_bf16") == 1 and "round_input" not in rest
    assert "r.template group_norm<float, 4, -1, -1>" in rest and "using Out = float;" in header
    s18 = Program(Gemm(True), (Norm("batch", 1e-5, training=True), Pointwise(call("silu", E.add(X, p(0)))), Widen()), ("scalar",))
    header = codegen.generate(s18, torch.bfloat16, "n", "e")["program.cuh"]
    assert "batch_norm_train<__nv_bfloat16, -1, -1>()" in header and "using Out = float;" in header


def test_a_pooling_narrows_the_rows_through_shared_memory_and_rounds_an_average():
    """Prog::out_width gives the runtime the output's width; the pooling needs the row in shared
    memory (whole rows a block); an average is rounded to T as eager's pooling returns it, a max
    is already a T value."""
    avg = Program.parse("linear(bias=True) | pointwise(bf16(relu(x))) | avg_pool(kernel=3, stride=2) | "
                        "pointwise(bf16(bf16(x) * 3.0))")
    header = codegen.generate(avg, torch.bfloat16, "n", "e")["program.cuh"]
    rest = body_of(header, "rest")
    assert "r.template pool_avg<3, 2>();\n    r.round_input();" in rest
    assert "n = n < 3 ? 0 : (n - 3) / 2 + 1;" in header and "s = s > n ? s : n;" in header
    assert "return false;" in header[header.index("row_local"):header.index("out_width")]
    max_sum = Program.parse("linear(bias=True) | max_pool(kernel=2, stride=2) | sum(keepdim=False)")
    rest = body_of(codegen.generate(max_sum, torch.bfloat16, "n", "e")["program.cuh"], "rest")
    assert "r.template pool_max<2, 2>();" in rest and "round_input" not in rest


def test_after_a_pooling_only_scalars_and_per_row_values_are_read():
    program = Program.parse("linear(bias=True) | max_pool(kernel=2, stride=2) | pointwise(x * p0) || col")
    with pytest.raises(codegen.UnsupportedProgram, match="after a pooling"):
        codegen.generate(program, torch.float32, "n", "e")


def test_a_program_widens_at_most_once():
    program = Program(Gemm(True), (Widen(), Reduce("softmax"), Widen()))
    with pytest.raises(codegen.UnsupportedProgram, match="more than one widening"):
        codegen.generate(program, torch.bfloat16, "n", "e")


def test_a_stage_drops_the_rounding_of_an_input_that_is_already_rounded():
    program = Program(Gemm(True), (Norm("group", 1e-5, groups=4), Pointwise(bf16(call("relu", bf16(X))))))
    body = body_of(codegen.generate(program, torch.bfloat16, "n", "e")["program.cuh"], "rest")
    assert "fx_relu(x)" in body and body.count("fx_round_bf16") == 1
    after_softmax = Program(Gemm(True), (Reduce("softmax"), Pointwise(bf16(call("relu", bf16(X))))))
    body = body_of(codegen.generate(after_softmax, torch.bfloat16, "n", "e")["program.cuh"], "rest")
    assert body.count("fx_round_bf16") == 2


def test_the_derivative_keeps_eagers_forward_and_rounds_no_gradient():
    """Masks, clamp bounds and output-reading derivatives see eager's bf16 values; the gradients
    stay float32 until the kernel stores dY (one rounding, as Inductor's derivative)."""
    traced = Program(Gemm(True), (Pointwise(bf16(call("clamp", bf16(E.mul(X, call("sigmoid", X))), c(-1.0), c(1.0)))),))
    header = codegen.generate(traced, torch.bfloat16, "n", "e")["program.cuh"]
    grad = header[header.index("static void grad(") :]
    grad = grad[: grad.index("\n  }\n")]
    forward = [line for line in grad.splitlines() if line.strip().startswith("const float t")]
    gradients = [line for line in grad.splitlines() if "g_" in line or "dx =" in line]
    assert sum("fx_round_bf16" in line for line in forward) == 2
    assert gradients and not any("fx_round" in line for line in gradients)
    assert "fx_clamp_bwd(g_t3, t2, t4, " in grad  # input and output as eager rounded them (t2, t4)


@pytest.mark.parametrize(
    "stages,params,kind,constants",
    [
        ((Pointwise(call("gelu", X)), Widen(), Reduce("softmax")), (), "fx::kReduceGrad",
         ["using MidU = float;", "kReduceKind = fx::kSoftmax;", "kHasPre = true;", "kHasPost = false;"]),
        ((Reduce("max", keepdim=True, ties="first"), Pointwise(E.mul(X, p(0)))), ("scalar",), "fx::kReduceGrad",
         ["using MidU = __nv_bfloat16;", "kReduceKind = fx::kMax;", "kTiesFirst = true;", "kPostParams = 1u;"]),
        ((Reduce("min"),), (), "fx::kReduceGrad", ["kReduceKind = fx::kMin;", "kTiesFirst = false;"]),
        ((Pointwise(E.mul(X, p(0))), Norm("layer", 1e-5, weight=1)), ("col", "col"), "fx::kNormGrad",
         ["using MidU = __nv_bfloat16;", "kNormKind = fx::kLayerNorm;", "kNormW = 1;", "kPreParams = 1u;"]),
        ((Norm("batch", 1e-5, weight=0, running_mean=1, running_var=2), Pointwise(call("relu", X))),
         ("col", "col", "col"), "fx::kNormGrad",
         ["kNormKind = fx::kBatchEvalNorm;", "kNormW = 0;", "kNormB = -1;", "kNormRM = 1;", "kNormRV = 2;",
          "kHasPost = true;"]),
        ((Norm("batch", 1e-5, training=True),), (), "fx::kNoGrad", []),
        ((Norm("layer", 1e-5), Reduce("sum")), (), "fx::kNoGrad", []),
    ],
    ids=["widened-softmax", "max-dim-then-scalar", "amin", "pre-then-layer-norm", "eval-batch-norm",
         "training-batch-norm", "two-middles"],
)
def test_a_row_programs_backward_is_its_split_around_one_norm_or_reduction(stages, params, kind, constants):
    header = codegen.generate(Program(Gemm(True), stages, params), torch.bfloat16, "n", "e")["program.cuh"]
    assert f"kGradKind = {kind};" in header
    for constant in constants:
        assert constant in header, constant


@pytest.mark.parametrize(
    "stages,condition",
    [
        ((Pointwise(call("relu", X)),), "true"),
        ((Norm("group", 1e-5, groups=8), Norm("batch", 1e-5, training=True)), "fx::group_in_lanes(n, 8, vec)"),
        ((Norm("layer", 1e-5),), "false"),
        ((Pointwise(call("relu", X)), Reduce("sum")), "false"),
        ((Norm("group", 1e-5, groups=8), Reduce("softmax")), "false"),
    ],
    ids=["pointwise", "small-groups-and-batch-norm", "layer-norm", "reduction", "row-map"],
)
def test_row_local_programs_are_those_without_row_statistics(stages, condition):
    header = codegen.generate(Program(Gemm(True), stages), torch.float32, "n", "e")["program.cuh"]
    assert f"return {condition};" in body_of(header.replace("(int64_t n, int vec)", "(R& r)"), "row_local")


@pytest.mark.parametrize(
    "program",
    [
        Program(Gemm(True), (Reduce("sum"), Pointwise(E.mul(X, p(0)))), ("col",)),
        Program(Gemm(True), (Reduce("sum"), Norm("layer", 1e-5))),
        Program(Gemm(True), (Reduce("max"), Reduce("softmax"))),
        Program(Gemm(True), (Norm("batch", 1e-5, training=True), Norm("batch", 1e-5, training=True))),
        Program(Gemm(True), (Norm("rms", 1e-5, weight=0, bias=1),), ("col", "col")),
        Program(Gemm(True), (Norm("batch", 1e-5),)),
        Program(Gemm(True), (Norm("layer", 1e-5, weight=0),), ("scalar",)),
        Program(Gemm(True), (Pointwise(E.mul(X, p(3))),), ("col",)),
        Program(Gemm(True), (Pointwise(E.mul(X, E.div(c(1.0), E.sub(c(1.0), c(1.0))))),)),
    ],
    ids=["col-after-reduce", "norm-after-reduce", "reduce-twice", "two-train-bn", "rms-bias", "eval-bn-no-stats",
         "scalar-weight", "missing-param", "constant-zero-division"],
)
def test_unsupported_programs_are_rejected(program):
    with pytest.raises(codegen.UnsupportedProgram):
        codegen.generate(program, torch.float32, "fxm_d", "e")


def test_unsupported_dtype():
    with pytest.raises(codegen.UnsupportedProgram):
        codegen.generate(Program(Gemm(True), ()), torch.float64, "fxm_e", "e")


def test_items_units():
    relu = Program(Gemm(True), (Pointwise(call("relu", X)),))
    widening = Program(Gemm(True), (Pointwise(call("relu", X)), Widen()))
    assert codegen.items_units(relu, torch.float32) == [1, 2, 4, 8, 16]
    assert codegen.items_units(relu, torch.bfloat16) == [1, 2, 4, 8]
    assert codegen.items_units(widening, torch.bfloat16) == [1, 2, 4, 8, 16]  # chunks of 4: 16 bytes of float
    widening_norm = Program(Gemm(True), (Widen(), Norm("layer", 1e-5)))
    assert codegen.items_units(widening_norm, torch.bfloat16) == [1, 2, 4, 8]  # 16 bytes of bf16, two stores


def test_float32_helper():
    assert float32(0.1) == struct.unpack("f", struct.pack("f", 0.1))[0]
    assert float32(1e39) == math.inf and math.isnan(float32(math.nan))
