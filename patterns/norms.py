"""The norm family: one entry per norm (group, layer, rms, batch), everything fxfuse knows of it.

An entry holds the norm's torch spelling, what the matcher requires of the value it normalises,
eager's arithmetic (the reference, and so the test oracle), and what the back ends need: the
statistics' shape, the row kernels' stage call, whether the in-GEMM epilogue takes it (its stage
there follows from the statistics' shape: csrc/gemm_group_norm.cuh per row group,
csrc/gemm_row_statistics.cuh per row, csrc/gemm_batch_norm.cuh per column; a norm of fixed
statistics is a pointwise expression there).
The matcher, the reference, the code generators and the policy read these entries rather than
switching on the norm's name. Adding a norm is an entry here plus its device stage in csrc.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Literal

import sympy
import torch
import torch.nn.functional as F

from .. import expr as E
from ..canonical import NormOp
from . import Spelling, spell

if TYPE_CHECKING:
    from ..ir import Norm

# per row (layer, rms), per row and group of columns (group), per column over all rows (batch)
Statistics = Literal["row", "row group", "column"]
Weights = Callable[[int | None], "torch.Tensor | None"]  # a parameter index -> its (N,) tensor


@dataclass(frozen=True)
class NormFamily:
    """One norm. ``over_channels``: torch normalises dim 1 (group and batch norm), which is the
    features only for a 2-D value; otherwise ``normalized_shape`` must be the last dim.
    ``reference(norm, x, p)``: eager's result on ``x`` (the norm's input in its own dtype; ``p``
    maps a parameter index to its vector) and, for a training batch norm, its batch statistics.
    ``row_stage(norm, element, p)``: the row kernels' call (csrc/row_epilogue.cuh; ``p`` maps a
    parameter index to its template argument, -1 for none); ``backward_code``: the norm's code in
    the generated backward (csrc/row_grad.cuh's NormCode; a batch norm's in eval mode).
    ``not_in_gemm(norm)``: why the in-GEMM epilogue does not take the norm, or None.
    ``as_pointwise(norm)``: the norm as a pointwise expression of x and its column parameters where
    its statistics are fixed (an eval-mode batch norm's running statistics), else None; the in-GEMM
    epilogue composes it with the pointwise stages around it. ``row_statistic``: the norm's
    fxg::RowStatistic, where the in-GEMM epilogue takes its statistics over the row
    (csrc/gemm_row_statistics.cuh)."""

    kind: str
    spelling: Spelling
    statistics: Statistics
    over_channels: bool
    takes_bias: bool
    reference: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
    row_stage: Callable[["Norm", str, Callable[[int | None], int]], str]
    backward_code: str
    check: Callable[[NormOp, int], str | None] = lambda op, n: None  # why the matcher stops, or None
    running_statistics: bool = False  # eval mode reads running statistics, training updates them
    not_in_gemm: Callable[["Norm"], str | None] = lambda norm: f"{norm.kind} norms are not in the in-GEMM epilogue yet"
    as_pointwise: Callable[["Norm"], sympy.Expr | None] = lambda norm: None
    row_statistic: str | None = None


# -- spellings (nn modules call these functions) -------------------------------------------------


def group_norm(input, num_groups, weight=None, bias=None, eps=1e-5):
    return NormOp("group", input, float(eps), groups=int(num_groups), weight=weight, bias=bias)


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    return NormOp("layer", input, float(eps), normalized_shape=shape, weight=weight, bias=bias)


def rms_norm(input, normalized_shape, weight=None, eps=None):
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    return NormOp("rms", input, None if eps is None else float(eps), normalized_shape=shape,
                  weight=weight)


def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False,
               momentum=0.1, eps=1e-5):
    return NormOp("batch", input, float(eps), weight=weight, bias=bias, running_mean=running_mean,
                  running_var=running_var, training=bool(training), momentum=momentum)


# -- eager's arithmetic -------------------------------------------------------------------------


def _batch_norm_reference(norm: Norm, x: torch.Tensor, p: Weights):
    if not norm.training:
        return F.batch_norm(x, p(norm.running_mean), p(norm.running_var), p(norm.weight), p(norm.bias),
                            False, 0.0, norm.eps), None
    out = F.batch_norm(x, None, None, p(norm.weight), p(norm.bias), True, 0.0, norm.eps)
    with torch.no_grad():  # what the op returns for the running statistics' update (unbiased)
        var, mean = torch.var_mean(x.detach().float(), dim=0, correction=1)
    return out, torch.stack([mean, var])


def _batch_norm_as_pointwise(norm: Norm) -> sympy.Expr | None:
    """Eval mode: (x - running_mean) / sqrt(running_var + eps) * weight + bias, per column."""
    if norm.training:
        return None
    x = E.mul(E.sub(E.X, E.param(norm.running_mean)),
              E.power(E.add(E.param(norm.running_var), E.const(norm.eps)), E.const(-0.5)))
    if norm.weight is not None:
        x = E.mul(x, E.param(norm.weight))
    return x if norm.bias is None else E.add(x, E.param(norm.bias))


def _batch_norm_stage(norm: Norm, element: str, p) -> str:
    if norm.training:
        return f"r.template batch_norm_train<{element}, {p(norm.weight)}, {p(norm.bias)}>();"
    return (f"r.template batch_norm_eval<{element}, {p(norm.weight)}, {p(norm.bias)}, "
            f"{p(norm.running_mean)}, {p(norm.running_var)}>({_eps(norm)});")


def _eps(norm: Norm) -> str:
    from ..cuda.printer import float_literal

    return float_literal(norm.eps)


FAMILY: dict[str, NormFamily] = {entry.kind: entry for entry in (
    NormFamily(
        "group", spell(group_norm, F.group_norm), "row group", over_channels=True, takes_bias=True,
        reference=lambda norm, x, p: (F.group_norm(x, norm.groups, p(norm.weight), p(norm.bias), norm.eps), None),
        row_stage=lambda norm, element, p: (f"r.template group_norm<{element}, {norm.groups}, {p(norm.weight)}, "
                                            f"{p(norm.bias)}>({_eps(norm)});"),
        check=lambda op, n: (None if op.groups > 0 and n % op.groups == 0
                             else f"num_groups={op.groups} does not divide {n} features"),
        backward_code="fx::kGroupNorm", not_in_gemm=lambda norm: None),
    NormFamily(
        "layer", spell(layer_norm, F.layer_norm), "row", over_channels=False, takes_bias=True,
        reference=lambda norm, x, p: (F.layer_norm(x, x.shape[-1:], p(norm.weight), p(norm.bias), norm.eps), None),
        row_stage=lambda norm, element, p: (f"r.template layer_norm<{element}, {p(norm.weight)}, "
                                            f"{p(norm.bias)}>({_eps(norm)});"),
        backward_code="fx::kLayerNorm", not_in_gemm=lambda norm: None, row_statistic="fxg::kRowLayerNorm"),
    NormFamily(
        "rms", spell(rms_norm, F.rms_norm, torch.rms_norm), "row", over_channels=False, takes_bias=False,
        reference=lambda norm, x, p: (F.rms_norm(x, x.shape[-1:], p(norm.weight), norm.eps), None),
        row_stage=lambda norm, element, p: f"r.template rms_norm<{element}, {p(norm.weight)}>({_eps(norm)});",
        backward_code="fx::kRmsNorm", not_in_gemm=lambda norm: None, row_statistic="fxg::kRowRmsNorm"),
    NormFamily(
        "batch", spell(batch_norm, F.batch_norm), "column", over_channels=True, takes_bias=True,
        reference=_batch_norm_reference, row_stage=_batch_norm_stage, backward_code="fx::kBatchEvalNorm",
        running_statistics=True, not_in_gemm=lambda norm: None, as_pointwise=_batch_norm_as_pointwise),
)}

SPELLINGS = tuple(entry.spelling for entry in FAMILY.values())
