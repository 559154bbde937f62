"""The Epilogue IR: a matched GEMM chain as a frozen, hashable value with a stable string form.

``Program(gemm, stages, params)`` is what every later step reads: the reference kernel, the fake
(meta) kernel, the CUDA code generator, the backward and the report. Its string form is the fused
op's ``program`` argument, names the JIT module and keys the build cache, so it is canonical:
``Program.parse(p.to_string()) == p`` and printing the result gives the same string again.

String form, stages separated by `` | `` and parameter kinds after `` || ``::

    linear(bias=True) | pointwise(leaky_relu(x * 2.0, 0.1)) | group_norm(groups=512, eps=1e-05,
    weight=p0, bias=p1) | sum(keepdim=True) || col col

A program is dtype-agnostic: it runs on the GEMM's dtype (the module is built per program and
dtype), a bfloat16/float16 chain carries its rounding points in its expressions, and a ``float32()``
stage marks where the chain widens to float32, as autocast and type promotion widen eager's, and a
``keep()`` stage marks a value the op returns too (a value the graph also reads elsewhere); a
``narrow()`` stage marks the cast back to the GEMM's dtype after a widened stretch; a
``dropout(p=0.1, seed=p2)`` stage is training-mode dropout, its masks drawn per call; an
``avg_pool(kernel=4, stride=4)`` / ``max_pool(...)`` stage pools windows of a row's values, and
the stages after it see the narrower row; a ``rotary(head_dim=64, cos=p0, sin=p1)`` stage is
attention's rotary embedding of each head of the row.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass, fields
from typing import Literal, Union

import sympy
import torch

from . import expr as E
from .patterns.feature_pooling import FAMILY as POOLS
from .patterns.functions import PREDICATES
from .patterns.norms import FAMILY as NORMS
from .patterns.reductions import FAMILY as REDUCTIONS
from .vocabulary import EpilogueFunction

# a per-column vector of N values, one value, a tensor of the output's shape (a residual, a gate),
# one value per row (an (M, 1) operand: a per-row scale, or read after a row reduction), a
# dropout stage's seed (two int64 values drawn from torch's generator on every call), or the (N, K)
# weight of a second GEMM on the op's input, whose output the epilogue reads (a gated MLP's up
# projection: ``silu(x @ Wg.T) * (x @ Wu.T)`` is one op), or a rotary embedding's cos or sin table
# ("head": a row of D values for every P-th row of the output, each head of D columns reading it:
# (B, T, D) or (1, T, D) or (T, D) tables against rows (B, T, H·D); output row r reads table row
# r mod P)
ParamKind = Literal["col", "scalar", "full", "row", "seed", "gemm", "head"]
NormKind = Literal["group", "layer", "rms", "batch"]
ReduceKind = Literal["sum", "mean", "max", "min", "logsumexp", "vector_norm", "var", "std", "softmax", "log_softmax",
                     "normalize"]

ROW_REDUCTIONS = tuple(k for k, family in REDUCTIONS.items() if family.changes_shape)  # sum, ..., vector_norm
ROW_MAPS = tuple(k for k, family in REDUCTIONS.items() if not family.changes_shape)  # softmax, log_softmax, normalize
TieRule = Literal["split", "first"]  # max/min: who takes the gradient where several elements tie


@dataclass(frozen=True)
class Gemm:
    """``y = x @ weight.T (+ bias)`` over the last dim of x; weight is (N, K)."""

    bias: bool


@dataclass(frozen=True)
class Pointwise:
    """An elementwise expression in ``x`` (the stage's input) and parameters ``p<i>``."""

    expr: sympy.Expr


@dataclass(frozen=True)
class Norm:
    """A normalisation over the feature (last) dim.

    group/layer/rms: statistics per row (per (row, group) for group norm). batch: statistics per
    column over all rows; with ``training`` the batch statistics are used and returned by the op
    (for the running-statistics update, done outside the op), otherwise the running statistics
    ``running_mean``/``running_var`` (parameter indices) are used.
    """

    kind: NormKind
    eps: float
    groups: int = 1
    weight: int | None = None
    bias: int | None = None
    training: bool = False
    running_mean: int | None = None
    running_var: int | None = None


@dataclass(frozen=True)
class Reduce:
    """A reduction over the feature dim (sum ... logsumexp, vector_norm, var, std) or a row map
    (softmax, log_softmax, normalize).

    ``ties`` is max/min's gradient rule, the one thing that tells eager's two spellings apart:
    ``amax``/``amin`` split the gradient evenly over the elements equal to the result ("split");
    ``max(dim)``/``min(dim)`` give all of it to the index they return, the first such element or
    the first NaN ("first"). The values are the same."""

    kind: ReduceKind
    keepdim: bool = False
    ties: TieRule = "split"
    eps: float | None = None  # normalize's: the norm is clamped to at least eps
    correction: float | None = None  # var's and std's: the divisor is the row's width less this

    def __post_init__(self) -> None:
        wanted = REDUCTIONS[self.kind].attribute
        for name in ("eps", "correction"):
            if (getattr(self, name) is not None) != (name == wanted):
                raise ValueError(f"{self.kind} {'takes' if name == wanted else 'takes no'} {name}")

    @property
    def changes_shape(self) -> bool:
        return self.kind in ROW_REDUCTIONS


@dataclass(frozen=True)
class Widen:
    """From here on the chain computes in float32, as eager's does where autocast runs an op in
    float32 (norms, softmax, sums on CUDA) or a float32 operand promotes one: the values are taken
    exactly, pointwise stages after it round nowhere, norms after it take and return float32, and
    the op's output is float32. The stages before it keep the GEMM dtype's rounding points; an op
    of the segment that widened reads them unrounded, so the stage sits at the end of that
    pointwise segment (before the norm or reduction that follows, or at the chain's end)."""


@dataclass(frozen=True)
class Narrow:
    """The chain's value is back in the GEMM's dtype: eager's cast back after a widened stretch
    (transformers' RMSNorms: ``weight * hidden.to(input_dtype)``). The rounding itself is in the
    expressions (the cast is a rounding point); the op's output is of the GEMM's dtype. Only
    pointwise stages follow it, and it follows a Widen."""


@dataclass(frozen=True)
class Keep:
    """The value here is an output of the op too (its fourth): a chain value the graph also reads
    outside the chain, such as a pre-norm block's residual sum (read by the norm and by the next
    block's residual add). Kept in the chain's dtype at this point (float32 after a Widen); at
    most one a program, before any reduction that changes the shape."""


@dataclass(frozen=True)
class Dropout:
    """Training-mode dropout: each element kept with probability 1 - ``p`` and scaled by
    1 / (1 - p), else zero (x * 0: NaN and Inf stay NaN, as eager's product does). The mask is a
    counter-based hash of (seed, row, column) of the (M, N) output, the seed parameter ``seed``
    (kind "seed") drawn from torch's generator on each call, so the backward, which recomputes the
    mask from the saved seed, drops the same elements. The result is rounded to the chain's dtype
    (eager's dropout returns its input's dtype)."""

    p: float
    seed: int


@dataclass(frozen=True)
class Pool:
    """Pooling along the feature dim (KernelBench's ``avg_pool1d(y.unsqueeze(1), k).squeeze(1)``,
    ``max_pool1d`` the same way): a row of n values becomes ``width(n)`` values, the mean
    (``kind="avg"``) or the max (NaN if the window holds one, as eager's) of each window of
    ``kernel`` values, windows ``stride`` apart, every window inside the row (no padding, floor
    mode). The result is rounded to the chain's dtype (eager's pooling returns its input's)."""

    kind: Literal["avg", "max"]
    kernel: int
    stride: int

    def width(self, n: int) -> int:
        """The pooled row's width (0 where the row is narrower than a window: eager raises)."""
        return (n - self.kernel) // self.stride + 1 if n >= self.kernel else 0


@dataclass(frozen=True)
class Rotary:
    """Attention's rotary embedding (RoPE) of every head of ``head_dim`` columns of the row, as
    transformers computes it: ``y * cos + cat(-y[D/2:], y[:D/2]) * sin`` per head, cos and sin the
    "head" parameters ``cos`` and ``sin``. Each product and the sum are rounded to the chain's
    dtype, as eager's three ops round them; the row keeps its width."""

    head_dim: int
    cos: int
    sin: int


Stage = Union[Pointwise, Norm, Reduce, Widen, Narrow, Keep, Dropout, Pool, Rotary]


@dataclass(frozen=True)
class Program:
    gemm: Gemm
    stages: tuple[Stage, ...]
    params: tuple[ParamKind, ...] = ()

    # -- derived facts ------------------------------------------------------------------------

    @property
    def reduction(self) -> Reduce | None:
        """The row reduction whose one value a row is the op's output: None where there is none,
        or where a later pointwise stage broadcasts that value (kept as (M, 1)) back against
        per-column values (``x.sum(-1, keepdim=True) * w``: a row of N again)."""
        found = None
        for stage in self.stages:
            if isinstance(stage, Reduce) and stage.changes_shape:
                found = stage
            elif found is not None and found.keepdim and isinstance(stage, Pointwise) and self.reads_columns(stage):
                found = None
        return found

    @property
    def broadcasts_back(self) -> bool:
        """A row reduction's value is broadcast back against per-column values (``reduction``)."""
        return self.reduction is None and any(isinstance(s, Reduce) and s.changes_shape for s in self.stages)

    def reads_columns(self, stage: Pointwise) -> bool:
        """Whether the stage's expression reads a per-column parameter."""
        indices = {E.param_index(s) for s in stage.expr.free_symbols}
        return any(i is not None and i < len(self.params) and read_as(self.params[i]) == "col" for i in indices)

    @property
    def channels_dim1(self) -> bool:
        """Whether a norm of the program is one torch applies to dim 1 as channels (batch, group):
        the features only where the value is 2-D, so the kernels cover 2-D inputs only."""
        return any(isinstance(s, Norm) and NORMS[s.kind].over_channels for s in self.stages)

    @property
    def batch_norm_training(self) -> Norm | None:
        return next(
            (s for s in self.stages if isinstance(s, Norm) and s.training),
            None,
        )

    @property
    def constant_params(self) -> frozenset[int]:
        """Parameters that get no gradient: running statistics (as in eager), rotary tables (the
        matcher only takes tables computed without a gradient) and operands only compared (a
        threshold: eager's comparisons give none, and its .grad stays None)."""
        stage_params = {
            i for s in self.stages
            for i in ((s.running_mean, s.running_var) if isinstance(s, Norm)
                      else (s.cos, s.sin) if isinstance(s, Rotary) else ())
            if i is not None
        }
        pointwise = [s.expr for s in self.stages if isinstance(s, Pointwise)]
        read = {E.param_index(sym) for e in pointwise for sym in e.free_symbols} - {None}
        differentiable = set().union(*(_params_outside_comparisons(e) for e in pointwise))
        norm_params = {i for s in self.stages if isinstance(s, Norm) for i in (s.weight, s.bias) if i is not None}
        return frozenset(stage_params | (read - differentiable - norm_params))

    @property
    def second_gemms(self) -> tuple[int, ...]:
        """The parameters that are a second GEMM's weight (kind "gemm"), in order: the op computes
        ``x @ weight.T`` for each, in the GEMM's dtype, and the epilogue reads that value."""
        return tuple(i for i, kind in enumerate(self.params) if kind == "gemm")

    @property
    def operand_kinds(self) -> tuple[ParamKind, ...]:
        """How the epilogue reads each parameter: a second GEMM's output is an operand of the
        output's shape, like a residual."""
        return tuple(read_as(kind) for kind in self.params)

    @property
    def keeps(self) -> bool:
        """Whether the op returns a kept value (a ``keep()`` stage)."""
        return any(isinstance(s, Keep) for s in self.stages)

    def kept_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The kept value's dtype for a GEMM in ``dtype``: the chain's dtype at the keep() stage."""
        at = next(i for i, s in enumerate(self.stages) if isinstance(s, Keep))
        return torch.promote_types(dtype, torch.float32) if _widened_after(self.stages[:at]) else dtype

    @property
    def widens(self) -> bool:
        return any(isinstance(s, Widen) for s in self.stages)

    @property
    def ends_widened(self) -> bool:
        """Whether the output is float32 in a bf16/fp16 chain: a Widen not cast back by a Narrow."""
        return _widened_after(self.stages)

    def output_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The op's output dtype for a GEMM in ``dtype`` (float64, which gradcheck uses, stays):
        float32 after a Widen, the GEMM's again after a Narrow."""
        return torch.promote_types(dtype, torch.float32) if self.ends_widened else dtype

    def width(self, n: int) -> int:
        """The row's width after every stage for a GEMM of ``n`` columns (a pooling narrows it;
        a row reduction's one value is ``output_shape``'s business)."""
        for stage in self.stages:
            if isinstance(stage, Pool):
                n = stage.width(n)
        return n

    @property
    def pools(self) -> bool:
        return any(isinstance(s, Pool) for s in self.stages)

    @property
    def steps(self) -> tuple[str, ...]:
        """The functions with jumps (floor, sign, threshold, ...) the program's expressions call."""
        calls = {f for s in self.stages if isinstance(s, Pointwise) for f in s.expr.atoms(EpilogueFunction)}
        return tuple(sorted({f.row.name for f in calls if not f.row.continuous}))

    def output_shape(self, batch_shape: tuple, n: int) -> tuple:
        """Shape of the op's output for an input of shape ``(*batch_shape, K)``."""
        reduction = self.reduction
        if reduction is None:
            return (*batch_shape, self.width(n))
        return (*batch_shape, 1) if reduction.keepdim else tuple(batch_shape)

    # -- string form --------------------------------------------------------------------------

    def to_string(self) -> str:
        parts = [f"linear(bias={self.gemm.bias})"] + [_stage_string(s) for s in self.stages]
        text = " | ".join(parts)
        return f"{text} || {' '.join(self.params)}" if self.params else text

    def __str__(self) -> str:
        return self.to_string()

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def parse(text: str) -> "Program":
        body, _, params = text.partition(" || ")
        gemm_text, *stage_texts = body.split(" | ")
        gemm_call = _call(gemm_text)
        if gemm_call.func.id != "linear":
            raise ValueError(f"a program starts with linear(...), not {gemm_text!r}")
        gemm = Gemm(**_keywords(gemm_call))
        return Program(gemm, tuple(_parse_stage(s) for s in stage_texts), tuple(params.split()))


# -- analyses ---------------------------------------------------------------------------------------


def read_as(kind: ParamKind) -> ParamKind:
    """How the epilogue reads a parameter of ``kind`` (a second GEMM's weight: its output, of the
    output's shape)."""
    return "full" if kind == "gemm" else kind


@dataclass(frozen=True)
class RowSplit:
    """A row program as ``pre | middle | post``: pre and post pointwise (each the composition of
    its stages; None when empty), the middle a group, layer or RMS norm or an eval-mode BatchNorm,
    a row reduction or a row map; ``widened`` when the middle computes in float32 (a Widen stage
    before it). The form the generated backward kernels take."""

    pre: sympy.Expr | None
    middle: Norm | Reduce
    post: sympy.Expr | None
    widened: bool

    @property
    def norm(self) -> Norm | None:
        return self.middle if isinstance(self.middle, Norm) else None

    @property
    def reduce(self) -> Reduce | None:
        return self.middle if isinstance(self.middle, Reduce) else None


def row_split(program: Program) -> RowSplit | None:
    """The program as ``pre | middle | post``; None where it is not of that form (a training
    BatchNorm, whose statistics are over all rows; two norms or reductions, or none; a stage pre
    and post cannot compose: a second output, a cast back, a dropout)."""
    middles = [i for i, s in enumerate(program.stages) if isinstance(s, (Norm, Reduce))]
    if len(middles) != 1:
        return None
    at = middles[0]
    middle = program.stages[at]
    if isinstance(middle, Norm) and middle.training:
        return None
    before, after = program.stages[:at], program.stages[at + 1 :]
    if not all(isinstance(s, (Pointwise, Widen)) for s in before + after):
        return None
    widened = any(isinstance(s, Widen) for s in before)
    return RowSplit(composed(before), middle, composed(after), widened)


GradientForm = Literal["pointwise", "norm", "reduce"]


def gradient_form(program: Program) -> GradientForm | None:
    """The form a generated backward of ``program`` takes: "pointwise" (every stage pointwise: one
    derivative per element), "norm" or "reduce" (a ``row_split``: pre's and post's derivatives
    around the middle's); None where it has none: a parameter whose gradient is not a column sum
    (an operand of the output's shape, a seed, a second GEMM), a reduction broadcast back, or
    stages of neither form."""
    if any(kind not in ("col", "scalar") for kind in program.params) or program.broadcasts_back:
        return None
    if all(isinstance(stage, Pointwise) for stage in program.stages):
        return "pointwise"
    split = row_split(program)
    if split is None:
        return None
    return "norm" if split.norm is not None else "reduce"


def composed(stages: tuple[Stage, ...]) -> sympy.Expr | None:
    """The pointwise stages as one expression (Widen stages only change where later ones round,
    which their expressions already say); None when there are none."""
    expression = None
    for stage in stages:
        if isinstance(stage, Pointwise):
            expression = stage.expr if expression is None else E.substitute(stage.expr, {E.X: expression})
    return expression


def _params_outside_comparisons(expr: sympy.Expr) -> set[int]:
    """The parameters ``expr`` reads other than as a comparison's operand (where no gradient
    flows)."""
    if isinstance(expr, EpilogueFunction) and expr.row.name in PREDICATES:
        return set()
    if isinstance(expr, sympy.Symbol):
        index = E.param_index(expr)
        return set() if index is None else {index}
    return set().union(*(_params_outside_comparisons(a) for a in expr.args))


def _widened_after(stages) -> bool:
    """Whether the chain computes in float32 after ``stages``: the last of its Widen and Narrow
    stages is a Widen."""
    markers = [s for s in stages if isinstance(s, (Widen, Narrow))]
    return bool(markers) and isinstance(markers[-1], Widen)


_NORM_NAMES = {"group": "group_norm", "layer": "layer_norm", "rms": "rms_norm", "batch": "batch_norm"}
_NORM_KINDS = {v: k for k, v in _NORM_NAMES.items()}
_PARAM_FIELDS = ("weight", "bias", "running_mean", "running_var")
_WIDEN_NAME = "float32"
_KEEP_NAME = "keep"
_NARROW_NAME = "narrow"
_DROPOUT_NAME = "dropout"
_ROTARY_NAME = "rotary"


def _stage_string(stage: Stage) -> str:
    if isinstance(stage, Pointwise):
        return f"pointwise({E.to_string(stage.expr)})"
    if isinstance(stage, Reduce):
        attribute = REDUCTIONS[stage.kind].attribute
        items = [] if attribute is None else [f"{attribute}={getattr(stage, attribute)!r}"]
        if stage.changes_shape:
            items.insert(0, f"keepdim={stage.keepdim}")
        if stage.ties != "split":
            items.append(f"ties={stage.ties!r}")
        return f"{stage.kind}({', '.join(items)})"
    if isinstance(stage, Widen):
        return f"{_WIDEN_NAME}()"
    if isinstance(stage, Keep):
        return f"{_KEEP_NAME}()"
    if isinstance(stage, Narrow):
        return f"{_NARROW_NAME}()"
    if isinstance(stage, Dropout):
        return f"{_DROPOUT_NAME}(p={stage.p!r}, seed=p{stage.seed})"
    if isinstance(stage, Pool):
        return f"{stage.kind}_pool(kernel={stage.kernel}, stride={stage.stride})"
    if isinstance(stage, Rotary):
        return f"{_ROTARY_NAME}(head_dim={stage.head_dim}, cos=p{stage.cos}, sin=p{stage.sin})"
    defaults = Norm(kind=stage.kind, eps=0.0)
    items = [f"eps={stage.eps!r}"]
    for f in fields(Norm)[2:]:
        value = getattr(stage, f.name)
        if value != getattr(defaults, f.name):
            items.append(f"{f.name}=p{value}" if f.name in _PARAM_FIELDS else f"{f.name}={value!r}")
    return f"{_NORM_NAMES[stage.kind]}({', '.join(items)})"


def _call(text: str) -> ast.Call:
    node = ast.parse(text, mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"not a stage: {text!r}")
    return node


def _keywords(node: ast.Call) -> dict:
    out = {}
    for kw in node.keywords:
        value = kw.value
        if isinstance(value, ast.Name) and E.param_index(sympy.Symbol(value.id)) is not None:
            out[kw.arg] = E.param_index(sympy.Symbol(value.id))
        else:
            out[kw.arg] = ast.literal_eval(value)
    return out


def _parse_stage(text: str) -> Stage:
    if text.startswith("pointwise(") and text.endswith(")"):
        return Pointwise(E.parse(text[len("pointwise(") : -1]))
    node = _call(text)
    name = node.func.id
    if name in _NORM_KINDS:
        return Norm(kind=_NORM_KINDS[name], **_keywords(node))
    if name in ROW_REDUCTIONS or name in ROW_MAPS:
        return Reduce(kind=name, **_keywords(node))
    if name == _WIDEN_NAME and not node.args and not node.keywords:
        return Widen()
    if name == _KEEP_NAME and not node.args and not node.keywords:
        return Keep()
    if name == _NARROW_NAME and not node.args and not node.keywords:
        return Narrow()
    if name == _DROPOUT_NAME and not node.args:
        return Dropout(**_keywords(node))
    if name == _ROTARY_NAME and not node.args:
        return Rotary(**_keywords(node))
    if name.endswith("_pool") and name[: -len("_pool")] in POOLS and not node.args:
        return Pool(kind=name[: -len("_pool")], **_keywords(node))
    raise ValueError(f"unknown stage {text!r}")
