"""Program -> CUDA sources of one program module.

The program becomes a ``struct Prog`` whose ``prefix``/``rest`` functions call the stages of
``csrc/row_epilogue.cuh`` on a register-resident row; small units instantiate the kernels for one
element type. ``prefix`` holds the stages before a training BatchNorm (the statistics kernel
recomputes them); ``rest`` holds everything else and the store. The template decides layout and
launch; the code generator only passes two measured per-program choices (``kLocalItems``, the
chunks a thread of row-local plans, and ``kVec``, the elements a chunk).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import sympy
import torch

from .. import expr as E
from .. import masks
from ..ir import (Dropout, Keep, Narrow, Norm, Pointwise, Pool, Program, Reduce, Rotary, RowSplit, Stage, Widen, composed,
                  gradient_form, row_split)
from ..patterns.feature_pooling import FAMILY as POOLS
from ..patterns.norms import FAMILY as NORMS
from ..patterns.reductions import FAMILY as REDUCTIONS
from ..vocabulary import ROUNDING, call, is_rounding
from .gradient import print_gradient
from .printer import UnsupportedExpression, float_literal, print_expr

CODEGEN_VERSION = "12"

ELEMENT_TYPES = {
    torch.float32: "float",
    torch.bfloat16: "__nv_bfloat16",
    torch.float16: "__half",
}

PARAM_KINDS = {"scalar": "FX_PARAM_SCALAR", "col": "FX_PARAM_COL", "full": "FX_PARAM_FULL",
               "seed": "FX_PARAM_SEED", "row": "FX_PARAM_ROW", "gemm": "FX_PARAM_GEMM",
               "head": "FX_PARAM_HEAD"}  # fx_abi.h
OUT_KINDS = {None: "FX_OUT_ROWS", False: "FX_OUT_REDUCED", True: "FX_OUT_REDUCED_KEEP"}


class UnsupportedProgram(ValueError):
    """A program this code generator does not compile; the caller keeps the chain unfused."""


VECTOR_ELEMENTS = {torch.float32: 4, torch.bfloat16: 8, torch.float16: 8}  # 16 bytes of T


def chunk_elements(program: Program, dtype: torch.dtype) -> int:
    """Elements a chunk (``Prog::kVec``): 16 bytes of the dtype. A bf16/fp16 chain that widens to
    a float32 output without a norm takes 16 bytes of float32 instead, so that a thread stores one
    whole 16-byte vector a chunk (S09 under bf16 autocast, H200: 1.01x Inductor's time, against
    1.03-1.04x with two half-sector stores a chunk); norm chains keep 16 bytes of the dtype (their
    group and row reductions span twice the lanes at 4 values a chunk: S08 1.20x against 1.05x,
    S20 1.06x against 1.03x, S02 1.05x against 1.01x)."""
    wide = VECTOR_ELEMENTS[program.output_dtype(dtype)]
    if wide < VECTOR_ELEMENTS[dtype] and not any(isinstance(s, Norm) for s in program.stages):
        return wide
    return VECTOR_ELEMENTS[dtype]


def group_in_lanes(n: int, groups: int, vec: int) -> bool:
    """Whether each group of a group norm over rows of ``n`` is whole chunks of ``vec`` values held
    by a power of two of at most 32 threads: the program is then row-local (its statistics are
    warp shuffles, its rows cut into segments), as csrc/row_epilogue.cuh's group_in_lanes says."""
    size = n // groups
    lanes = size // vec
    return n % groups == 0 and size % vec == 0 and 1 <= lanes <= 32 and lanes & (lanes - 1) == 0


def items_units(program: Program, dtype: torch.dtype) -> list[int]:
    """The chunk counts a thread (ITEMS) compiled for ``program`` on ``dtype``: 1, 2, 4, ... 64 / VEC."""
    top = 64 // chunk_elements(program, dtype)
    return [1 << k for k in range(top.bit_length()) if 1 << k <= top]


def generate(program: Program, dtype: torch.dtype, namespace: str, entry: str, ext: str = ".cu",
             one_unit: bool = False) -> dict[str, str]:
    """The sources of one program module: file name -> text.

    ``program.cuh`` defines ``Prog``; ``main<ext>`` exports the entry point; ``items_<I><ext>``
    holds the kernels of one ITEMS value (separate units so that ninja builds them in parallel).
    With ``one_unit`` (the host emulator: a unit's cost there is mostly parsing the headers)
    ``module<ext>`` holds all of it. ``namespace`` keeps the kernels' symbols apart from other
    modules; ``entry`` names the exported ``extern "C"`` function that returns the program's
    FxProgramInfo.
    """
    if dtype not in ELEMENT_TYPES:
        raise UnsupportedProgram(f"element type {dtype} (float32, bfloat16 and float16 only)")
    element = ELEMENT_TYPES[dtype]
    header = [f"// fxfuse program module (codegen {CODEGEN_VERSION}), element type {element}"]
    sources = {"program.cuh": _program_header(program, dtype, namespace)}
    program_line = f"FX_DEFINE_PROGRAM({namespace}::Prog, {element}, {entry})"
    items_lines = {items: f"FX_DEFINE_ITEMS_UNIT({namespace}::Prog, {element}, {items})"
                   for items in items_units(program, dtype)}
    if one_unit:
        sources[f"module{ext}"] = "\n".join(
            [*header, "#define FX_ITEMS_UNIT", '#include "program.cuh"', "", *items_lines.values(), program_line, ""]
        )
        return sources
    sources[f"main{ext}"] = "\n".join([*header, '#include "program.cuh"', "", program_line, ""])
    for items, line in items_lines.items():
        sources[f"items_{items}{ext}"] = "\n".join([*header, "#define FX_ITEMS_UNIT", '#include "program.cuh"', "", line, ""])
    return sources


def _program_header(program: Program, dtype: torch.dtype, namespace: str) -> str:
    _check(program)
    split = _batch_train_index(program)
    prefix = program.stages[:split] if split is not None else ()
    rest = program.stages[split:] if split is not None else program.stages
    try:
        emitter = _Emitter(program, dtype)
        prefix_body = emitter.stages(prefix, store=False)
        if split is not None:  # the statistics kernel reads the BatchNorm's input off prefix()
            prefix_body += emitter.norm_input()
        rest_body = emitter.stages(rest, store=True)
    except UnsupportedExpression as error:
        raise UnsupportedProgram(str(error)) from None
    backward = _backward_lines(program, dtype)
    reduction = program.reduction
    kinds = [PARAM_KINDS[kind] for kind in program.params] or ["FX_PARAM_SCALAR"]
    groups = [s.groups for s in program.stages if isinstance(s, Norm) and NORMS[s.kind].statistics == "row group"]
    pools = [s for s in program.stages if isinstance(s, Pool)]
    rotary = [s.head_dim for s in program.stages if isinstance(s, Rotary)]
    bn = program.batch_norm_training
    comment = program.to_string().replace("*/", "* /")
    return "\n".join(
        [
            f"// fxfuse program (codegen {CODEGEN_VERSION}), element type {ELEMENT_TYPES[dtype]}",
            f"/* {comment} */",
            "#pragma once",
            '#include "row_epilogue.cuh"',
            "",
            f"namespace {namespace} {{",
            "",
            "struct Prog {",
            f"  static constexpr int kNumParams = {len(program.params)};",
            f"  static constexpr int kParamSlots = {max(1, len(program.params))};",
            f"  static constexpr int32_t kParamKinds[kParamSlots] = {{{', '.join(kinds)}}};",
            f"  static constexpr int32_t kOutKind = {OUT_KINDS[None if reduction is None else reduction.keepdim]};",
            f"  static constexpr bool kBatchTrain = {'true' if bn else 'false'};",
            f"  static constexpr bool kChannelsDim1 = {'true' if program.channels_dim1 else 'false'};",
            f"  static constexpr float kBatchEps = {float_literal(bn.eps) if bn else '0.0f'};",
            "  // the training BatchNorm's weight and bias parameters (-1: none), which its combine folds",
            f"  static constexpr int kBatchWeight = {-1 if bn is None or bn.weight is None else bn.weight};",
            f"  static constexpr int kBatchBias = {-1 if bn is None or bn.bias is None else bn.bias};",
            f"  static constexpr int kLocalItems = {_local_items(program)};  // chunks a thread, row-local plans",
            f"  using Out = {ELEMENT_TYPES[program.output_dtype(dtype)]};  // the output's element type",
            f"  static constexpr bool kKeeps = {'true' if program.keeps else 'false'};  // a keep() stage: a second output",
            f"  using Kept = {ELEMENT_TYPES[program.kept_dtype(dtype) if program.keeps else dtype]};  // its element type",
            f"  static constexpr int kVec = {chunk_elements(program, dtype)};  // elements a chunk",
            "",
            "  static bool groups_ok(int64_t n) {",
            "    return " + " && ".join([f"n % {g} == 0" for g in groups] + [f"n % {d} == 0" for d in rotary]
                                     or ["true"]) + ";",
            "  }",
            "",
            "  // no statistic of a row wider than a warp (the launch plan's choice)",
            "  static bool row_local(int64_t n, int vec) {",
            "    (void)n;",
            "    (void)vec;",
            f"    return {_row_local(program)};",
            "  }",
            "",
            "  // the output rows' width (a pooling narrows them)",
            "  static int64_t out_width(int64_t n) {",
            *[f"    n = n < {p.kernel} ? 0 : (n - {p.kernel}) / {p.stride} + 1;" for p in pools],
            "    return n;",
            "  }",
            "",
            "  static int64_t scratch_floats(int64_t n, int vec) {",
            "    int64_t s = 0;",
            *[f"    s = fx::group_norm_scratch(s, n, vec, {g});" for g in groups],
            *(["    s = s > n ? s : n;  // a pooling's row"] if pools else []),
            *[f"    s = fx::rotary_in_lanes(n, {d}, vec) || s > n ? s : n;  // a rotary embedding's row" for d in rotary],
            "    (void)n;",
            "    (void)vec;",
            "    return s;",
            "  }",
            "",
            "  template <class R>",
            "  FX_DEVICE static void prefix(R& r) {",
            "    (void)r;",
            *_indent(prefix_body, 4),
            "  }",
            "",
            "  template <class R>",
            "  FX_DEVICE static void rest(R& r) {",
            "    (void)r;",
            *_indent(rest_body, 4),
            "  }",
            "",
            *_indent(backward, 2),
            "};",
            "",
            f"}}  // namespace {namespace}",
            "",
        ]
    )


# -- validation ---------------------------------------------------------------------------------


def unsupported_reason(program: Program) -> str | None:
    """Why the row kernels cannot run ``program`` (None: they can)."""
    try:
        _check(program)
    except UnsupportedProgram as error:
        return str(error)
    return None


def _check(program: Program) -> None:
    """Reject what the kernels cannot express, before any source is written."""
    for kind in program.params:
        if kind not in PARAM_KINDS:
            raise UnsupportedProgram(f"parameter kind {kind!r}")
    trains = [s for s in program.stages if isinstance(s, Norm) and s.training]
    keeps = [i for i, s in enumerate(program.stages) if isinstance(s, Keep)]
    if len(keeps) > 1:
        raise UnsupportedProgram("more than one second output")
    if keeps and trains and keeps[0] < program.stages.index(trains[0]):
        raise UnsupportedProgram("a second output before a training BatchNorm (the statistics kernel recomputes it)")
    if len(trains) > 1:
        raise UnsupportedProgram("more than one training BatchNorm")
    if sum(isinstance(s, Widen) for s in program.stages) > 1:
        raise UnsupportedProgram("more than one widening to float32")
    narrows = [i for i, s in enumerate(program.stages) if isinstance(s, Narrow)]
    if narrows and (len(narrows) > 1 or not program.widens or narrows[0] != len(program.stages) - 1):
        raise UnsupportedProgram("a cast back to the GEMM's dtype other than at the end of a widened chain")
    for stage in program.stages:
        if isinstance(stage, Dropout) and not (0 <= stage.seed < len(program.params)
                                               and program.params[stage.seed] == "seed"):
            raise UnsupportedProgram(f"dropout seed p{stage.seed} is not a seed parameter")
    pools = [i for i, s in enumerate(program.stages) if isinstance(s, Pool)]
    if len(pools) > 1:
        raise UnsupportedProgram("more than one pooling")
    after_pool = program.stages[pools[0] + 1:] if pools else ()
    if any(isinstance(s, (Norm, Keep, Dropout, Pool)) for s in after_pool):
        raise UnsupportedProgram("a norm, dropout or second output after a pooling")
    read_after_pool = {E.param_index(sym) for s in after_pool if isinstance(s, Pointwise) for sym in s.expr.free_symbols}
    if any(i is not None and program.operand_kinds[i] not in ("scalar", "row") for i in read_after_pool):
        raise UnsupportedProgram("an operand other than a scalar or one value per row after a pooling")
    for stage in program.stages:
        if isinstance(stage, Pool) and (stage.kernel < 1 or stage.stride < 1 or stage.kind not in POOLS):
            raise UnsupportedProgram(f"pooling {stage}")
        if isinstance(stage, Rotary) and (stage.head_dim < 2 or stage.head_dim % 2 or any(
                not 0 <= i < len(program.params) or program.params[i] != "head" for i in (stage.cos, stage.sin))):
            raise UnsupportedProgram(f"rotary embedding {stage}")
    if any(kind == "head" for kind in program.params) and not any(isinstance(s, Rotary) for s in program.stages):
        raise UnsupportedProgram("a rotary table outside a rotary embedding")
    for stage in program.stages:
        read = {E.param_index(sym) for sym in stage.expr.free_symbols} if isinstance(stage, Pointwise) else set()
        if any(i is not None and i < len(program.params) and program.params[i] == "head" for i in read):
            raise UnsupportedProgram("a rotary table read by a pointwise stage")
    reduced = False
    for stage in program.stages:
        if reduced and not isinstance(stage, Pointwise):
            raise UnsupportedProgram(f"{type(stage).__name__} after a reduction")
        if isinstance(stage, Norm):
            _check_norm(program, stage)
        if isinstance(stage, Reduce) and stage.changes_shape:
            reduced = True


def _check_norm(program: Program, norm: Norm) -> None:
    def col(index: int | None, role: str, required: bool = False) -> None:
        if index is None:
            if required:
                raise UnsupportedProgram(f"{norm.kind} norm without {role}")
            return
        if not 0 <= index < len(program.params) or program.params[index] != "col":
            raise UnsupportedProgram(f"{norm.kind} norm {role} p{index} is not a column parameter")

    if not math.isfinite(norm.eps):
        raise UnsupportedProgram(f"{norm.kind} norm eps {norm.eps}")
    col(norm.weight, "weight")
    col(norm.bias, "bias")
    family = NORMS[norm.kind]
    if family.statistics == "row group" and norm.groups < 1:
        raise UnsupportedProgram(f"group norm with {norm.groups} groups")
    if not family.takes_bias and norm.bias is not None:
        raise UnsupportedProgram(f"{norm.kind} norm with a bias")
    if family.running_statistics and not norm.training:
        col(norm.running_mean, "running_mean", required=True)
        col(norm.running_var, "running_var", required=True)


def _reduce_attribute(stage: Reduce | None) -> str:
    """The literal of the one attribute ``stage``'s kind reads (normalize's eps, var's correction),
    or ''."""
    attribute = None if stage is None else REDUCTIONS[stage.kind].attribute
    return "" if attribute is None else float_literal(getattr(stage, attribute))


def _row_local(program: Program) -> str:
    """C++ condition on (n, vec): every statistic and partner the rows need is warp-local (group
    norms of small groups, rotary heads paired by lane shuffles; batch norms take column statistics
    from another kernel)."""
    terms = []
    for stage in program.stages:
        if isinstance(stage, (Reduce, Pool)) or (isinstance(stage, Norm) and NORMS[stage.kind].statistics == "row"):
            return "false"
        if isinstance(stage, Rotary):  # heads of whole chunks in a warp's lanes: segments of whole heads
            terms.append(f"fx::rotary_in_lanes(n, {stage.head_dim}, vec)")
        if isinstance(stage, Norm) and NORMS[stage.kind].statistics == "row group":
            terms.append(f"fx::group_in_lanes(n, {stage.groups}, vec)")
    return " && ".join(terms) or "true"


def _local_items(program: Program) -> int:
    """16-byte chunks a thread when the program runs row-local (a sweep of apply plans on an H200,
    bf16 suite rows, bench/results/plan_sweep_bf16.txt): group norms' shuffle trees want warps, one chunk a thread (S02,
    S04, S08, S17); pointwise and batch-norm chains want fewer, busier threads, four (S01, S03)."""
    return 1 if any(isinstance(s, Norm) and NORMS[s.kind].statistics == "row group" for s in program.stages) else 4


# -- the backward ---------------------------------------------------------------------------------

def _pointwise_expression(program: Program) -> sympy.Expr:
    """A pointwise program's stages as one expression (the identity for none)."""
    expression = composed(program.stages)
    return E.X if expression is None else expression


def has_generated_backward(program: Program) -> bool:
    """Whether the program's modules carry a backward kernel: the row kernels run its forward, it
    has a gradient form (``ir.gradient_form``) and its derivatives print (the dtype only changes
    where they round); otherwise the op's backward stays plain torch ops for Inductor."""
    return unsupported_reason(program) is None and _derivatives(program, torch.float32)[0] != "fx::kNoGrad"


GRAD_KINDS = {"pointwise": "fx::kPointwiseGrad", "norm": "fx::kNormGrad", "reduce": "fx::kReduceGrad"}


def _derivatives(program: Program, dtype: torch.dtype) -> tuple[str, dict[str, list[str]], RowSplit | None]:
    """The program's kGradKind, its printed derivative functions by name (``grad`` for a
    pointwise program, ``grad_pre`` / ``grad_post`` for a row program's non-empty sides) and a row
    program's split; kNoGrad (none) where the program has no gradient form or a derivative does
    not print."""
    form = gradient_form(program)
    functions: dict[str, list[str]] = {}
    try:
        if form == "pointwise":
            functions["grad"] = _gradient_function("grad", _pointwise_expression(program), program, dtype)
            return GRAD_KINDS[form], functions, None
        if form is not None:
            split = row_split(program)
            once_a_row = split.reduce is not None and split.reduce.changes_shape  # a reduction's post
            for name, expression in (("grad_pre", split.pre), ("grad_post", split.post)):
                if expression is not None:
                    rounds = once_a_row and name == "grad_post"
                    functions[name] = _gradient_function(name, expression, program, dtype, rounds)
            return GRAD_KINDS[form], functions, split
    except UnsupportedExpression:
        pass
    return "fx::kNoGrad", {}, None


def _backward_lines(program: Program, dtype: torch.dtype) -> list[str]:
    """``Prog``'s backward members: kGradKind; ``grad`` (a pointwise program's derivative at one
    element, grad_epilogue.cuh); a row program's split (row_grad.cuh): the middle stage's
    constants, ``pre`` (pre's value at one element) and ``grad_pre`` / ``grad_post`` (pre's and
    post's derivatives, the forward recomputed from their input). Members a program does not use
    are identities or defaults, so that every module compiles the same templates."""
    kind, functions, split = _derivatives(program, dtype)
    norm = split.norm if split else None
    reduce = split.reduce if split else None
    pre = split.pre if split else None
    post = split.post if split else None

    def param(index: int | None) -> int:
        return -1 if index is None else index

    def function(name: str) -> list[str]:
        return functions.get(name) or _identity_gradient(name)

    return [
        "// the backward: a pointwise program's grad_kernel (grad_epilogue.cuh) or a row program's",
        "// row_grad_kernel (row_grad.cuh)",
        f"static constexpr int kGradKind = {kind};",
        *function("grad"),
        "// the dtype a norm computes for",
        f"using MidU = {ELEMENT_TYPES[torch.float32 if split is None or split.widened else dtype]};",
        f"static constexpr int kNormKind = {NORMS[norm.kind].backward_code if norm else 'fx::kLayerNorm'};",
        f"static constexpr int kNormGroups = {norm.groups if norm else 1};",
        f"static constexpr int kNormW = {param(norm.weight) if norm else -1};",
        f"static constexpr int kNormB = {param(norm.bias) if norm else -1};",
        f"static constexpr int kNormRM = {param(norm.running_mean) if norm else -1};",
        f"static constexpr int kNormRV = {param(norm.running_var) if norm else -1};",
        f"static constexpr float kNormEps = {float_literal(norm.eps) if norm else '0.0f'};",
        f"static constexpr int kReduceKind = {REDUCTIONS[reduce.kind].backward_code if reduce else 'fx::kSum'};",
        f"static constexpr bool kTiesFirst = {'true' if reduce and reduce.ties == 'first' else 'false'};",
        f"static constexpr float kReduceAttribute = {_reduce_attribute(reduce) or '0.0f'};  // eps, correction",
        f"static constexpr bool kHasPre = {'true' if pre is not None else 'false'};",
        f"static constexpr bool kHasPost = {'true' if post is not None else 'false'};",
        f"static constexpr uint32_t kColParams = {sum(1 << i for i, k in enumerate(program.params) if k == 'col')}u;",
        f"static constexpr uint32_t kPreParams = {_param_mask(pre)}u;",
        f"static constexpr uint32_t kPostParams = {_param_mask(post)}u;",
        *_value_function("pre", pre),
        *function("grad_pre"),
        *function("grad_post"),
    ]


def _gradient_function(name: str, expression: sympy.Expr, program: Program, dtype: torch.dtype,
                       round_gradients: bool = False) -> list[str]:
    """``name(x, g, p, dx, dp)``: the gradients of ``expression`` at one element (its forward and
    reverse sweep, fxfuse/cuda/gradient.py; ``round_gradients`` where it runs once a row);
    UnsupportedExpression where no derivative prints."""
    printed = print_gradient(expression, dtype, len(program.params), round_gradients=round_gradients)
    _param_indices(program, printed.params, "col")  # every parameter is the program's
    body = [f"const float p{i} = p[{i}];" for i in sorted(printed.params)] + printed.lines
    return [
        f"FX_DEVICE static void {name}(float x, float g, const float* p, float& dx, float* dp) {{",
        "  (void)x;",
        "  (void)p;",
        "  (void)dp;",
        *_indent(body, 2),
        "}",
    ]


def _identity_gradient(name: str) -> list[str]:
    return [f"FX_DEVICE static void {name}(float, float g, const float*, float& dx, float*) {{ dx = g; }}"]


def _value_function(name: str, expression: sympy.Expr | None) -> list[str]:
    """``name(x, p)``: the value of ``expression`` at one element, as the forward computes it."""
    if expression is None:
        return [f"FX_DEVICE static float {name}(float x, const float*) {{ return x; }}"]
    printed = print_expr(expression)
    return [
        f"FX_DEVICE static float {name}(float x, const float* p) {{",
        "  (void)p;",
        *_indent([f"const float p{i} = p[{i}];" for i in sorted(printed.params)] + printed.lines, 2),
        f"  return {printed.result};",
        "}",
    ]


def _param_mask(expression: sympy.Expr | None) -> int:
    if expression is None:
        return 0
    return sum(1 << i for i in {E.param_index(s) for s in expression.free_symbols} if i is not None)


def _batch_train_index(program: Program) -> int | None:
    for i, stage in enumerate(program.stages):
        if isinstance(stage, Norm) and stage.training:
            return i
    return None


# -- emission -----------------------------------------------------------------------------------


class _Emitter:
    """Emits stages in order, tracking whether the row holds values of the element type T (a low
    precision chain rounds after every op where eager rounds): a norm rounds its input only when
    it is not, and a pointwise stage drops the rounding of its input ``x`` when it already is.
    After a Widen stage the chain computes in float32: nothing rounds, norms are float norms."""

    def __init__(self, program: Program, dtype: torch.dtype) -> None:
        self.program = program
        self.gemm_dtype = dtype
        self.dtype = dtype  # the dtype the chain computes in: the element type, float32 once widened
        self.rounded = True  # the GEMM output is loaded as T values

    @property
    def rounding(self) -> str | None:
        """The vocabulary's rounding function of the current dtype, None in float32."""
        return ROUNDING.get(self.dtype)

    def stages(self, stages: tuple[Stage, ...], store: bool) -> list[str]:
        lines: list[str] = []
        reduced = False  # after a row reduction the value is the float `s`
        for stage in stages:
            if isinstance(stage, Pointwise):
                stage = Pointwise(self._without_input_rounding(stage.expr))
                if reduced and self.program.broadcasts_back and self.program.reads_columns(stage):  # a row of N again
                    lines.append("r.fill(s);")
                    reduced = False
                lines += _emit_scalar_pointwise(self.program, stage) if reduced else _emit_map(self.program, stage)
                self.rounded = self._is_rounding(stage.expr)
            elif isinstance(stage, Norm):
                lines += self.norm_input()
                lines.append(_emit_norm(stage, ELEMENT_TYPES[self.dtype]))
                self.rounded = True  # Row::normalise rounds to the norm's type
            elif isinstance(stage, Widen):
                self.dtype, self.rounded = torch.float32, True
            elif isinstance(stage, Narrow):  # the last stage: its rounding is the expression's
                self.dtype = self.gemm_dtype
            elif isinstance(stage, Keep):
                if reduced:
                    raise UnsupportedProgram("a second output after a row reduction")
                lines.append("r.store_kept();")  # rounds to Prog::Kept at the store
            elif isinstance(stage, Dropout):  # eager's dropout reads and returns the chain's dtype
                lines += self.norm_input()
                lines.append(f"r.template dropout<{stage.seed}>({masks.threshold(stage.p)}u, "
                             f"{float_literal(masks.scale(stage.p))});")
                if self.rounding is not None:
                    lines.append("r.round_input();")
                self.rounded = True
            elif isinstance(stage, Pool):  # eager pools values of the chain's dtype and returns one
                lines += self.norm_input()
                lines.append(f"r.template {POOLS[stage.kind].row_stage}<{stage.kernel}, {stage.stride}>();")
                if stage.kind == "avg" and self.rounding is not None:
                    lines.append("r.round_input();")
            elif isinstance(stage, Rotary):  # eager's three ops on the chain's dtype, each rounding
                lines += self.norm_input()
                lines.append(f"r.template rotary<{ELEMENT_TYPES[self.dtype]}, {stage.head_dim}, {stage.cos}, "
                             f"{stage.sin}>();")
                self.rounded = True
            else:
                call = f"r.{REDUCTIONS[stage.kind].row_stage}({_reduce_attribute(stage)})"
                if stage.changes_shape:
                    lines.append(f"float s = {call};")
                    reduced = True
                else:
                    lines.append(f"{call};")
                self.rounded = False
        if store:
            lines.append("r.store_scalar(s);" if reduced else "r.store_rows();")
        return lines

    def norm_input(self) -> list[str]:
        """The row rounded to T, as eager's norm of a T input sees it, unless it already is."""
        if self.rounded or self.rounding is None:
            return []
        self.rounded = True
        return ["r.round_input();"]

    def _is_rounding(self, expr) -> bool:
        return self.rounding is None or is_rounding(expr, self.dtype)

    def _without_input_rounding(self, expr):
        if self.rounding is None or not self.rounded:
            return expr
        return E.substitute(expr, {call(self.rounding, E.X): E.X})


def _param_indices(program: Program, used: set[int], kind: str) -> list[int]:
    for index in used:
        if index >= len(program.params):
            raise UnsupportedExpression(f"p{index} is not a parameter of the program")
    return [i for i in sorted(used) if program.operand_kinds[i] == kind]


def _once_a_row_decls(program: Program, used: set[int]) -> list[str]:
    """The scalar and per-row parameters an expression reads: one value each for the whole row."""
    return ([f"const float p{i} = r.template scalar_param<{i}>();" for i in _param_indices(program, used, "scalar")]
            + [f"const float p{i} = r.template row_param<{i}>();" for i in _param_indices(program, used, "row")])


def _emit_map(program: Program, stage: Pointwise) -> list[str]:
    """One pass over the row's chunks: column parameters are loaded once a chunk (16 bytes at a
    time), then the expression runs on each of the chunk's elements."""
    printed = print_expr(stage.expr)
    cols = _param_indices(program, printed.params, "col")
    fulls = _param_indices(program, printed.params, "full")
    return [
        "{",
        *_indent(_once_a_row_decls(program, printed.params), 2),
        "  r.map_chunks([&](auto& v, int i) {",
        "    (void)i;",
        *[line for k in cols for line in (f"    float p{k}v[R::VEC];", f"    r.template col_chunk<{k}>(i, p{k}v);")],
        *[line for k in fulls for line in (f"    float p{k}v[R::VEC];", f"    r.template full_chunk<{k}>(i, p{k}v);")],
        "#pragma unroll",
        "    for (int e = 0; e < R::VEC; ++e) {",
        "      const float x = v[e];",
        *[f"      const float p{k} = p{k}v[e];" for k in cols + fulls],
        *_indent(printed.lines, 6),
        f"      v[e] = {printed.result};",
        "    }",
        "  });",
        "}",
    ]


def _emit_scalar_pointwise(program: Program, stage: Pointwise) -> list[str]:
    printed = print_expr(stage.expr)
    if any(i < len(program.params) and program.params[i] not in ("scalar", "row") for i in printed.params):
        raise UnsupportedProgram("a column or full parameter after a reduction")
    return [
        "{",
        "  const float x = s;",
        *_indent(_once_a_row_decls(program, printed.params), 2),
        *_indent(printed.lines, 2),
        f"  s = {printed.result};",
        "}",
    ]


def _emit_norm(norm: Norm, element: str) -> str:
    """The norm's call on the row, computing for ``element`` (T, or float once widened)."""
    return NORMS[norm.kind].row_stage(norm, element, lambda index: -1 if index is None else index)


def _indent(lines: list[str], spaces: int) -> list[str]:
    return [" " * spaces + line for line in lines]
