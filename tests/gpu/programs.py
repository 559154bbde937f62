"""Programs the GPU tests, the emulator tests and the compile check share, built from the IR."""

from __future__ import annotations

import torch

from fxfuse import expr as E
from fxfuse.ir import Dropout, Gemm, Keep, Norm, Pointwise, Program, Reduce, Rotary, Widen, row_split
from fxfuse.masks import SEED_HIGH
from fxfuse.vocabulary import POINTWISE, call

X = E.X
p = E.param
c = E.const

# attribute values for the vocabulary functions that take some
ATTRS = {
    "leaky_relu": (0.1,),
    "clamp": (-0.5, 0.75),
    "hardtanh": (-0.75, 0.5),
    "clamp_min": (-0.25,),
    "clamp_max": (0.5,),
    "elu": (1.3,),
    "softplus": (2.0, 3.0),
    "celu": (0.6,),
    "threshold": (0.1, -2.0),
    "hardshrink": (0.4,),
    "softshrink": (0.3,),
}


# functions defined on the positive numbers take |operand| (+ 1/8): a NaN at every negative value
# would hide the other functions' values in a vocabulary program's sum
POSITIVE = {"log": lambda a: E.add(call("abs", a), c(0.125)), "log1p": lambda a: call("abs", a)}


def vocabulary_call(name: str, operand=X):
    """``name`` applied to ``operand`` (against p0 for the two-operand functions)."""
    row = POINTWISE[name]
    operand = POSITIVE.get(name, lambda a: a)(operand)
    operands = [operand] + ([p(0)] if row.operands == 2 else [])
    return call(name, *operands, *(c(a) for a in ATTRS.get(name, ())))


def vocabulary_program(names: list[str]) -> Program:
    """The sum of ``f(x * 1.5 - 0.25)`` over the functions ``names`` (p0 the second operand of
    maximum/minimum): one module checks many functions' accuracy (NaN/Inf behaviour is checked
    per function by the device-function tests)."""
    arg = E.sub(E.mul(X, c(1.5)), c(0.25))
    total = None
    for name in names:
        term = vocabulary_call(name, arg)
        total = term if total is None else E.add(total, term)
    params = ("col",) if any(POINTWISE[n].operands == 2 for n in names) else ()
    return Program(Gemm(bias=True), (Pointwise(total),), params)


def pw(expression) -> Pointwise:
    return Pointwise(expression)


def silu_twice() -> Pointwise:  # x * sigmoid(x): a value used twice
    return pw(E.mul(X, call("sigmoid", X)))


# name -> Program; the suite's chains and the corner cases of every stage kind
PROGRAMS: dict[str, Program] = {
    "identity": Program(Gemm(bias=False), ()),
    "s01_scale_leaky": Program(Gemm(True), (pw(call("leaky_relu", E.mul(X, c(2.0)), c(0.1))),)),
    "s02_group_leaky_double": Program(
        Gemm(True),
        (
            Norm("group", 1e-5, groups=4, weight=0, bias=1),
            pw(E.add(call("leaky_relu", X, c(0.01)), call("leaky_relu", X, c(0.01)))),
        ),
        ("col", "col"),
    ),
    "s04_group_silu_vec_silu": Program(
        Gemm(True),
        (
            Norm("group", 1e-5, groups=8, weight=0, bias=1),
            pw(
                E.mul(
                    E.mul(E.mul(X, call("sigmoid", X)), p(2)),
                    call("sigmoid", E.mul(E.mul(X, call("sigmoid", X)), p(2))),
                )
            ),
        ),
        ("col", "col", "col"),
    ),
    "s05_logsumexp_chain": Program(
        Gemm(True),
        (
            Reduce("logsumexp", keepdim=True),
            pw(call("gelu", call("gelu", call("leaky_relu", call("leaky_relu", X, c(0.01)), c(0.01))))),
        ),
    ),
    "s06_group_hardtanh": Program(
        Gemm(True), (Norm("group", 1e-5, groups=2, weight=0, bias=1), pw(call("hardtanh", X, c(-2.0), c(2.0)))), ("col", "col")
    ),
    "s10_div_gelu": Program(Gemm(True), (pw(call("gelu", E.div(X, c(10.0)))),)),
    "s11_gelu_softmax": Program(Gemm(True), (pw(call("gelu", X)), Reduce("softmax"))),
    "s13_sub_mul_relu": Program(Gemm(True), (pw(call("relu", E.mul(E.sub(X, c(2.0)), c(1.5)))),)),
    "s14_silu_div_clamp_tanh": Program(
        Gemm(False),
        (
            pw(
                call(
                    "clamp",
                    call("tanh", call("clamp", E.div(E.mul(X, call("sigmoid", X)), c(2.0)), c(-1.0), c(1.0))),
                    c(-1.0),
                    c(1.0),
                )
            ),
        ),
    ),
    "s15_div_sum_mul": Program(Gemm(False), (pw(E.div(X, c(2.0))), Reduce("sum", keepdim=True), pw(E.mul(X, c(1.5))))),
    "s16_sigmoid_sum": Program(Gemm(True), (pw(call("sigmoid", X)), Reduce("sum", keepdim=True))),
    "s17_vec_hardtanh_mish_group": Program(
        Gemm(True),
        (
            pw(call("mish", call("clamp", E.add(X, p(0)), c(-1.0), c(1.0)))),
            Norm("group", 1e-5, groups=4, weight=1, bias=2),
        ),
        ("col", "col", "col"),
    ),
    "s18_batch_train_scalar_silu": Program(
        Gemm(True),
        (
            Norm("batch", 1e-5, weight=0, bias=1, training=True),
            pw(E.mul(E.div(E.add(X, p(2)), c(1.0)), call("sigmoid", E.div(E.add(X, p(2)), c(1.0))))),
        ),
        ("col", "col", "scalar"),
    ),
    "s03_batch_train_gelu_relu": Program(
        Gemm(True), (Norm("batch", 1e-5, weight=0, bias=1, training=True), pw(call("relu", call("gelu", X)))), ("col", "col")
    ),
    "s07_vec_batch_train": Program(
        Gemm(True), (pw(E.mul(X, p(0))), Norm("batch", 1e-5, weight=1, bias=2, training=True)), ("col", "col", "col")
    ),
    "batch_train_after_layer": Program(
        Gemm(True),
        (Norm("layer", 1e-5, weight=0, bias=1), Norm("batch", 1e-3, training=True), pw(E.mul(X, c(3.0)))),
        ("col", "col"),
    ),
    "s20_layer_silu": Program(Gemm(True), (Norm("layer", 1e-5, weight=0, bias=1), pw(call("silu", X))), ("col", "col")),
    "layer_no_affine": Program(Gemm(True), (Norm("layer", 1e-6),)),
    "s21_rms_silu": Program(Gemm(True), (Norm("rms", 1e-6, weight=0), pw(call("silu", X))), ("col",)),
    "rms_no_weight": Program(Gemm(False), (Norm("rms", 1e-5),)),
    "s22_batch_eval_relu": Program(
        Gemm(True),
        (Norm("batch", 1e-5, weight=0, bias=1, running_mean=2, running_var=3), pw(call("relu", X))),
        ("col", "col", "col", "col"),
    ),
    # a BatchNorm in eval mode between stages with parameters (a frozen BatchNorm being fine-tuned)
    "vec_batch_eval_silu_scalar": Program(
        Gemm(False),
        (
            pw(E.mul(X, p(0))),
            Norm("batch", 1e-3, weight=1, running_mean=2, running_var=3),
            pw(E.add(call("silu", X), p(4))),
        ),
        ("col", "col", "col", "col", "scalar"),
    ),
    "group_odd": Program(Gemm(True), (Norm("group", 1e-5, groups=5, weight=0, bias=1),), ("col", "col")),
    "group_no_affine_then_layer": Program(Gemm(True), (Norm("group", 1e-5, groups=2), Norm("layer", 1e-5))),
    "log_softmax_then_pointwise": Program(Gemm(True), (Reduce("log_softmax"), pw(E.mul(X, p(0)))), ("col",)),
    "scalar_param_pow": Program(
        Gemm(True), (pw(E.add(E.power(X, c(2.0)), E.div(c(1.0), E.add(call("abs", X), p(0))))),), ("scalar",)
    ),
    "powers": Program(
        Gemm(True),
        (pw(E.add(E.add(E.power(call("abs", X), c(0.5)), E.power(X, c(3.0))), E.power(E.add(call("abs", X), c(1.0)), c(-1.5)))),),
    ),
    # operands of the output's shape: a residual add (BERT, GPT-2), a residual then LayerNorm (BERT's
    # output block), a gate (SwiGLU's silu(gate) * up), a residual before a training BatchNorm (the
    # statistics kernel reads it too)
    "full_residual": Program(Gemm(True), (pw(E.add(X, p(0))),), ("full",)),
    "full_residual_layer": Program(
        Gemm(True), (pw(E.add(X, p(0))), Norm("layer", 1e-12, weight=1, bias=2)), ("full", "col", "col")
    ),
    "full_gate_silu": Program(Gemm(False), (pw(E.mul(call("silu", X), p(0))),), ("full",)),
    # a gated MLP as one op: the up projection is a second GEMM on the same x (Llama's SwiGLU; T5's
    # gated GELU with a scale after it)
    "gemm_gate_silu": Program(Gemm(False), (pw(E.mul(call("silu", X), p(0))),), ("gemm",)),
    # written with the up projection first: up(x) * silu(gate(x)), the activation on the second GEMM
    "gemm_up_first_silu": Program(Gemm(False), (pw(E.mul(X, call("silu", p(0)))),), ("gemm",)),
    "gemm_gate_gelu_scaled": Program(Gemm(True), (pw(E.mul(E.mul(call("gelu_tanh", X), p(0)), p(1))),),
                                     ("gemm", "col")),
    "full_residual_batch_train": Program(
        Gemm(True), (pw(E.add(X, p(0))), Norm("batch", 1e-5, weight=1, bias=2, training=True)), ("full", "col", "col")
    ),
    # a second output: a pre-norm block's residual sum, kept, then normalised (GPT-2, ViT); under
    # autocast kept in float32 after the chain widened (Llama's to(float32) before its RMSNorm)
    "keep_residual_layer": Program(
        Gemm(True), (pw(E.add(X, p(0))), Keep(), Norm("layer", 1e-5, weight=1, bias=2)), ("full", "col", "col")
    ),
    "widen_keep_rms": Program(Gemm(False), (pw(E.add(X, p(0))), Widen(), Keep(), Norm("rms", 1e-6, weight=1)),
                              ("full", "col")),
    # training-mode dropout (masks hashed from a seed parameter): BERT's output block (dense,
    # dropout, residual, LayerNorm), a dropout after an activation, at p = 0.5
    "dropout_residual_layer": Program(
        Gemm(True), (Dropout(0.1, 0), pw(E.add(X, p(1))), Norm("layer", 1e-12, weight=2, bias=3)),
        ("seed", "full", "col", "col"),
    ),
    "gelu_dropout": Program(Gemm(True), (pw(call("gelu", X)), Dropout(0.5, 0)), ("seed",)),
    # one value per row: a per-row scale inside the chain, and an (M, 1) operand after a row
    # reduction (the reduced value and another tensor of its shape)
    "row_scale_gelu": Program(Gemm(True), (pw(E.mul(call("gelu", X), p(0))),), ("row",)),
    "row_after_sum": Program(Gemm(True), (pw(call("sigmoid", X)), Reduce("sum", keepdim=True),
                                          pw(E.add(E.mul(X, p(0)), p(1)))), ("row", "scalar")),
    "minus_and_negation": Program(Gemm(True), (pw(E.sub(E.neg(X), E.sub(c(2.0), E.mul(c(3.0), X)))),)),
    # chains that widen to float32 as autocast's do (the output is float32; a no-op in float32)
    "widen_s08_silu_vec_group": Program(
        Gemm(True),
        (pw(E.add(E.mul(X, call("sigmoid", X)), p(0))), Widen(), Norm("group", 1e-5, groups=4, weight=1, bias=2)),
        ("col", "col", "col"),
    ),
    "widen_s09_vec_relu": Program(Gemm(False), (pw(call("relu", E.add(X, p(0)))), Widen()), ("col",)),
    "widen_s20_layer_silu": Program(
        Gemm(True), (Widen(), Norm("layer", 1e-5, weight=0, bias=1), pw(call("silu", X))), ("col", "col")
    ),
    "widen_s11_gelu_softmax": Program(Gemm(True), (pw(call("gelu", X)), Widen(), Reduce("softmax"))),
    "widen_s05_logsumexp_chain": Program(
        Gemm(True), (Widen(), Reduce("logsumexp", keepdim=True), pw(call("gelu", call("leaky_relu", X, c(0.01)))))
    ),
    "widen_s07_vec_batch_train": Program(
        Gemm(True), (pw(E.mul(X, p(0))), Widen(), Norm("batch", 1e-5, weight=1, bias=2, training=True)),
        ("col", "col", "col"),
    ),
    "widen_s18_batch_train_scalar_silu": Program(
        Gemm(True),
        (
            Norm("batch", 1e-5, weight=0, bias=1, training=True),
            pw(E.mul(E.add(X, p(2)), call("sigmoid", E.add(X, p(2))))),
            Widen(),
        ),
        ("col", "col", "scalar"),
    ),
    "widen_rms_then_group": Program(
        Gemm(False), (Norm("rms", 1e-6, weight=0), Widen(), Norm("group", 1e-5, groups=2)), ("col",)
    ),
}

for _kind in ("sum", "mean", "max", "min", "logsumexp", "vector_norm"):
    for _keep in (False, True):
        PROGRAMS[f"reduce_{_kind}_{'keep' if _keep else 'drop'}"] = Program(
            Gemm(True), (Reduce(_kind, keepdim=_keep), pw(E.add(E.mul(X, p(0)), c(0.5)))), ("scalar",)
        )
# var / std: Bessel's correction and none
PROGRAMS["reduce_var_keep"] = Program(
    Gemm(True), (Reduce("var", keepdim=True, correction=1.0), pw(E.add(E.mul(X, p(0)), c(0.5)))), ("scalar",)
)
PROGRAMS["reduce_std_drop"] = Program(Gemm(True), (pw(call("relu", X)), Reduce("std", correction=0.0)))
# F.normalize: the default eps, and a large one that tiny rows fall under (clamp_min's gradient 0)
PROGRAMS["normalize_then_col"] = Program(
    Gemm(True), (pw(call("relu", X)), Reduce("normalize", eps=1e-12), pw(E.add(E.mul(X, p(0)), c(0.5)))), ("col",)
)
PROGRAMS["normalize_large_eps"] = Program(Gemm(False), (Reduce("normalize", eps=1e-3),))
# a row over its written Euclidean norm (CLIP's embeddings): eps 0, NaN on a row of zeros
PROGRAMS["normalize_no_eps"] = Program(Gemm(False), (Reduce("normalize", eps=0.0), pw(E.mul(X, c(2.5)))))
# torch.where(y > 0, y, 0.2 * y) and a mask multiplied in, y * (y < p0) (comparisons: 1 or 0)
_POSITIVE = call("gt", X, c(0.0))
PROGRAMS["where_leaky"] = Program(
    Gemm(True), (pw(E.add(call("pick", _POSITIVE, X), call("pick", E.sub(c(1.0), _POSITIVE), E.mul(X, c(0.2))))),))
PROGRAMS["mask_below_col"] = Program(Gemm(False), (pw(E.mul(X, call("lt", X, p(0)))),), ("col",))
# attention's rotary embedding of heads of 16 (after the bias), and of heads of 64 between pointwise
# stages (cos and sin: a table row for every P-th output row, make_params)
PROGRAMS["rotary_heads"] = Program(Gemm(True), (Rotary(16, 0, 1),), ("head", "head"))
PROGRAMS["rotary_between_pointwise"] = Program(
    Gemm(False), (pw(E.mul(X, c(0.5))), Rotary(64, 1, 0), pw(E.add(X, c(1.0)))), ("head", "head"))
# heads of 24: 3 (bf16) or 6 (float32) chunks a head, which lane shuffles cannot pair (the scratch path)
PROGRAMS["rotary_heads_of_24"] = Program(Gemm(True), (Rotary(24, 0, 1),), ("head", "head"))
# max(dim)/min(dim): the gradient to the first maximum (Reduce.ties), after a pre stage
PROGRAMS["reduce_max_first_drop"] = Program(Gemm(True), (pw(call("relu", X)), Reduce("max", ties="first")))
PROGRAMS["reduce_min_first_keep"] = Program(
    Gemm(False), (pw(E.mul(X, p(0))), Reduce("min", keepdim=True, ties="first")), ("col",)
)

# as Dynamo traces S05 and S11 in bfloat16: a rounding point after every op
PROGRAMS["s05_traced_bf16"] = Program.parse(
    "linear(bias=True) | logsumexp(keepdim=True) | pointwise(bf16(gelu(bf16(gelu(bf16(leaky_relu(bf16(leaky_relu("
    "bf16(x), 0.01)), 0.01)))))))"
)


def s04_traced_bf16(groups: int) -> Program:
    """S04 as a bf16 model traces it, in ``groups`` groups: a rounding point after every op."""
    return Program.parse(
        f"linear(bias=True) | group_norm(eps=1e-05, groups={groups}, weight=p0, bias=p1) | pointwise(bf16(bf16(bf16("
        "bf16(x) * bf16(sigmoid(bf16(x)))) * p2) * bf16(sigmoid(bf16(bf16(bf16(x) * bf16(sigmoid(bf16(x)))) * p2))))) "
        "|| col col col")


# The suite's chain in 8 groups. Not among PROGRAMS: the generated backward's column sums of p2
# exceed the backward test's bound (0.067 against 0.05 at 5 x 2048, in the emulator), though its
# errors against the float64 derivative are the reference's size (BENCHMARKS.md section 35).
S04_TRACED_BF16 = s04_traced_bf16(8)
# in the suite's own 256 groups (32 values a group at 8192 columns: the group norm inside a warp's
# lanes), for timing and profiling the pass at the suite's shapes (bench/row_pass.py)
S04_SUITE_BF16 = s04_traced_bf16(256)
# a row reduction's value broadcast back against per-column values: a row of N again
PROGRAMS["reduce_sum_keep_broadcast"] = Program(
    Gemm(True), (pw(call("relu", X)), Reduce("sum", keepdim=True), pw(E.add(E.mul(X, p(0)), p(1)))), ("col", "scalar"))
PROGRAMS["reduce_mean_broadcast_traced_bf16"] = Program.parse(
    "linear(bias=True) | pointwise(bf16(relu(x))) | mean(keepdim=True) | "
    "pointwise(bf16(sigmoid(bf16(bf16(bf16(x) * p0) + 0.5)))) || col")
PROGRAMS["s11_traced_bf16"] = Program.parse("linear(bias=True) | pointwise(bf16(gelu(x))) | softmax()")
# transformers' RMSNorm in a bf16 model: the norm in float32, cast back, the weight multiply in bf16
PROGRAMS["narrow_traced_bf16"] = Program.parse(
    "linear(bias=False) | float32() | rms_norm(eps=1e-06) | pointwise(bf16(p0 * bf16(x))) | narrow() || col")
# GPT-2's MLP output in a bf16 model: c_proj, dropout, the residual add
PROGRAMS["dropout_traced_bf16"] = Program.parse(
    "linear(bias=True) | pointwise(bf16(gelu(x))) | dropout(p=0.1, seed=p0) | pointwise(bf16(x + p1)) || seed full")

# pooling along the features (KernelBench's max_pool1d / avg_pool1d of the rows viewed as one channel)
PROGRAMS["pool_max_sum_scale"] = Program.parse(
    "linear(bias=True) | max_pool(kernel=2, stride=2) | sum(keepdim=False) | pointwise(x * 0.5)")
PROGRAMS["pool_avg_gelu_scale_max"] = Program.parse(
    "linear(bias=True) | avg_pool(kernel=4, stride=4) | pointwise(gelu(x) * 2.0) | max(keepdim=False, ties='first')")
PROGRAMS["pool_avg_overlapping_rows"] = Program.parse(  # windows overlap; odd widths: the scalar stores
    "linear(bias=False) | pointwise(sigmoid(x * p0)) | avg_pool(kernel=3, stride=2) | pointwise(x * 2.0 + 1.0) || col")
PROGRAMS["pool_max_rows"] = Program.parse("linear(bias=True) | max_pool(kernel=4, stride=4)")
PROGRAMS["pool_then_softmax"] = Program.parse(  # a row map over the narrower row
    "linear(bias=True) | max_pool(kernel=3, stride=3) | pointwise(x * 0.5) | softmax()")
PROGRAMS["group_then_pool"] = Program.parse(  # the group norm's scratch, then the pooling's
    "linear(bias=True) | group_norm(eps=1e-05, groups=4) | avg_pool(kernel=2, stride=2) | mean(keepdim=True)")
PROGRAMS["batch_train_then_pool"] = Program.parse(  # the statistics kernel, then a pooling in the apply kernel
    "linear(bias=True) | batch_norm(eps=1e-05, training=True) | max_pool(kernel=4, stride=2)")
PROGRAMS["pool_traced_bf16"] = Program.parse(  # the pooled value rounds to bf16, as eager's pooling returns it
    "linear(bias=True) | pointwise(bf16(relu(x))) | avg_pool(kernel=2, stride=2) | pointwise(bf16(bf16(x) * 3.0)) "
    "| sum(keepdim=True)")

_names = list(POINTWISE)
PROGRAMS["vocabulary_1"] = vocabulary_program(_names[: len(_names) // 2])
PROGRAMS["vocabulary_2"] = vocabulary_program(_names[len(_names) // 2 :])

# programs each test dtype runs in full (the others run in float32 only)
LOW_PRECISION = ["s01_scale_leaky", "s04_group_silu_vec_silu", "s03_batch_train_gelu_relu", "s11_gelu_softmax",
                 "s22_batch_eval_relu",
                 "s16_sigmoid_sum", "s21_rms_silu", "group_odd", "s05_traced_bf16", "s11_traced_bf16",
                 "full_residual_layer", "full_gate_silu", "keep_residual_layer", "narrow_traced_bf16",
                 "dropout_residual_layer", "gelu_dropout", "dropout_traced_bf16", "row_scale_gelu",
                 "row_after_sum", "gemm_gate_silu", "gemm_gate_gelu_scaled", "reduce_sum_keep_broadcast",
                 "reduce_mean_broadcast_traced_bf16", "pool_max_sum_scale", "pool_avg_overlapping_rows",
                 "rotary_heads", "rotary_between_pointwise", "rotary_heads_of_24", "where_leaky", "mask_below_col",
                 "pool_traced_bf16", "group_then_pool", "batch_train_then_pool"] + [
                     name for name in PROGRAMS if name.startswith("widen_")]
TRACED_IN_BF16 = ["s05_traced_bf16", "s11_traced_bf16", "narrow_traced_bf16", "dropout_traced_bf16",
                  "reduce_mean_broadcast_traced_bf16", "pool_traced_bf16"]  # their rounding points are a bf16 chain's


def fits(program: Program, n: int) -> bool:
    """Whether rows of ``n`` suit ``program``: its group norms' groups divide them and its
    poolings' windows fit in them (else eager raises, and so does the op)."""
    groups = all(n % s.groups == 0 for s in program.stages if isinstance(s, Norm) and s.kind == "group")
    heads = all(n % s.head_dim == 0 for s in program.stages if isinstance(s, Rotary))
    return groups and heads and program.width(n) >= 1


def dtypes_of(name: str) -> list[torch.dtype]:
    """The dtypes the tests run ``name`` in: float32, and bfloat16 and float16 for the
    low-precision programs; a program traced in bfloat16 in those two only (in float32 its
    rounding points would put bf16 rounding steps into a float32 chain's tolerance)."""
    low = [torch.bfloat16, torch.float16] if name in LOW_PRECISION else []
    return low if name in TRACED_IN_BF16 else [torch.float32] + low


def make_params(program: Program, n: int, dtype=torch.float32, device="cpu", generator=None,
                lead: tuple[int, ...] | None = None, k: int | None = None) -> list[torch.Tensor]:
    """Parameters for ``program``: column vectors of N values, scalars as 0-d tensors, full ones
    of the output's shape ``(*lead, N)``, row ones of ``(*lead, 1)`` (``lead``: x's leading dims),
    a second GEMM's (N, K) weight in the GEMM's dtype (``k``: x's last dim), rotary tables of a row
    of D values for each of the last leading dim's rows (the (T, D) table of rows (B, T, N); with
    one leading dim, one a row). Variance-like parameters
    (BatchNorm running_var) are positive. A program that widens gets float32 ones, as autocast's
    float32 model has (a float32 norm of bf16 parameters is an error in eager)."""
    if ({"full", "row", "head"} & set(program.params)) and lead is None:
        raise ValueError("a program with a full or row parameter needs the output's leading dims (lead=)")
    if "gemm" in program.params and k is None:
        raise ValueError("a program with a second GEMM needs its K (k=)")
    positive = {s.running_var for s in program.stages if isinstance(s, Norm) and s.running_var is not None}
    gemm_dtype, dtype = dtype, torch.float32 if program.widens else dtype
    out = []
    for i, kind in enumerate(program.params):
        if kind == "seed":  # a dropout stage's seed: two int64 values, as the rewrite draws them
            seed = torch.randint(0, SEED_HIGH, (2,), generator=generator, dtype=torch.int64)  # a CPU generator
            out.append(seed.to(device))
            continue
        if kind == "gemm":
            weight = torch.randn(n, k, generator=generator, dtype=torch.float32) / k ** 0.5
            out.append(weight.to(dtype=gemm_dtype, device=device))
            continue
        head_dim = next((s.head_dim for s in program.stages if isinstance(s, Rotary)), 1)
        shape = {"col": (n,), "scalar": (), "full": (*(lead or ()), n), "row": (*(lead or ()), 1),
                 "head": ((lead or (1,))[-1], head_dim)}[kind]
        t = torch.randn(shape, generator=generator, dtype=torch.float32)
        if i in positive:
            t = t.abs() + 0.5
        out.append(t.to(dtype=dtype, device=device))
    return out


def poison(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """NaN in an input row, Inf and NaN in two weight rows, -Inf in the bias (in place; N > 500)."""
    x[1, 3] = float("nan")
    w[7, 0] = float("inf")
    w[500, 2] = float("nan")
    if b is not None:
        b[11] = float("-inf")


# -- the generated backward (pointwise and row programs) -------------------------------------------


def backward_covers(program: Program, dtype: torch.dtype, n: int) -> bool:
    """Whether the generated backward kernel covers rows of ``n`` (the tests take the row kernel's
    group norms of groups whose chunks a warp's lanes hold; others fall back to the reference)."""
    from fxfuse.cuda import codegen

    split = row_split(program)
    if split is None or split.norm is None or split.norm.kind != "group":
        return True
    return codegen.group_in_lanes(n, split.norm.groups, codegen.chunk_elements(program, dtype))


def grad_cases(shapes: list[tuple[int, int]]):
    """(name, dtype, M, N) for every program with a generated backward and every shape its kernel
    covers: float32, and bfloat16 and float16 for the suite's low-precision programs."""
    from fxfuse.cuda import codegen

    for name, program in PROGRAMS.items():
        if not codegen.has_generated_backward(program):
            continue
        for dtype in dtypes_of(name):
            for m, n in shapes:
                if backward_covers(program, dtype, n):
                    yield name, dtype, m, n


def assert_backward_close(program: Program, got, want, tol: float, col_atol: float, scalar_atol: float) -> None:
    """``(dy, sums)`` of fxfuse::epilogue_backward against the reference's: dy elementwise, the
    column sums of dy and of each column parameter's gradient per column, a scalar parameter's
    gradient as its row's total (the reference puts all of it in column 0).

    A column sum of dy may differ by ``tol`` relative to the norm of its summands, not only by
    ``col_atol``: two float32 sums of large terms in different orders differ by a few ulps of the
    terms (the reference's own sum of 4096 terms up to 4e6 is 0.006 off the exact one)."""
    (dy, sums), (ref_dy, ref_sums) = got, want
    rtol = tol
    if any(isinstance(s, Norm) for s in program.stages) and dy.dtype != torch.float32:
        # the norm's backward sums a group in another order than eager's kernel: where its terms
        # cancel, the float32 difference can move dY's rounding by two units in the last place
        rtol = max(tol, 2 * torch.finfo(dy.dtype).eps)
    torch.testing.assert_close(dy.float(), ref_dy.float(), rtol=rtol, atol=tol, equal_nan=True)
    assert sums.shape == ref_sums.shape and sums.dtype == torch.float32
    scalar = [1 + i for i, kind in enumerate(program.params) if kind == "scalar"]
    cols = [r for r in range(sums.shape[0]) if r not in scalar]
    n = ref_dy.shape[-1]
    summands = ref_dy.float().reshape(-1, n).nan_to_num(0.0, 0.0, 0.0).norm(dim=0)
    allowed = torch.clamp(tol * summands, min=col_atol) + tol * ref_sums[0].abs()
    error = (sums[0] - ref_sums[0]).abs()
    same_nan = sums[0].isnan() == ref_sums[0].isnan()
    bad = ~same_nan | (~ref_sums[0].isnan() & ~((error <= allowed) | (sums[0] == ref_sums[0])))
    assert not bad.any(), f"dy column sums off at {bad.nonzero().flatten()[:8].tolist()}: {error[bad][:8].tolist()}"
    torch.testing.assert_close(sums[cols[1:]], ref_sums[cols[1:]], rtol=tol, atol=col_atol, equal_nan=True)
    if scalar:
        torch.testing.assert_close(sums[scalar].sum(1), ref_sums[scalar].sum(1), rtol=tol, atol=scalar_atol,
                                   equal_nan=True)


# -- backward edge cases (the emulator's tests and the device's draw the same) ---------------------

REDUCTION_EDGES = ["reduce_max_keep", "reduce_min_drop", "reduce_max_first_drop", "reduce_min_first_keep",
                   "reduce_logsumexp_keep", "reduce_mean_drop", "reduce_vector_norm_keep", "normalize_then_col",
                   "normalize_no_eps", "reduce_var_keep", "reduce_std_drop", "s11_gelu_softmax", "log_softmax_then_pointwise"]
ZERO_ROW_NORMS = ["reduce_vector_norm_keep", "reduce_vector_norm_drop", "normalize_no_eps", "normalize_large_eps",
                  "reduce_std_drop"]


def reduction_edges(program: Program) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(y, grad, params): rows of small integers, where max and min tie, and rows holding NaN,
    +inf, -inf, only -inf or only zeros (a vector norm of zero: eager's gradient is 0 there)."""
    import math

    g = torch.Generator().manual_seed(7)
    y = torch.randint(-3, 4, (9, 40), generator=g).float()
    y[1, 3], y[2, 5], y[3, 7], y[5, 2], y[5, 9] = math.nan, math.inf, -math.inf, math.nan, math.nan
    y[4] = -math.inf
    y[6] = 0.0
    grad = torch.randn(program.output_shape((9,), 40), generator=g)
    return y, grad, make_params(program, 40, generator=g)


def rows_of_zeros(program: Program) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(y, grad, params): rows of zeros reached by a finite, an infinite, a NaN and a zero gradient."""
    import math

    g = torch.Generator().manual_seed(9)
    y = torch.randn(6, 40, generator=g)
    y[1:5] = 0.0
    grad = torch.randn(program.output_shape((6,), 40), generator=g)
    grad[2].fill_(math.inf)
    grad[3].fill_(math.nan)
    grad[4].fill_(0.0)
    return y, grad, make_params(program, 40, generator=g)

