"""Row reductions and row maps over the feature dim: sum, mean, amax/amin, max/min(dim) (with
``.values`` / ``[0]``), logsumexp, softmax, log_softmax."""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch.fx import Node

from ..canonical import AliasOp, PointwiseOp, ReduceOp, Rejected
from . import spell


def _reduction(kind: str):
    def build(input, dim=None, keepdim=False, *, dtype=None):
        if dim is None:
            return Rejected(f"{kind} over every dim")
        if dtype is not None:
            return Rejected(f"{kind} with dtype={dtype}")
        return ReduceOp(kind, input, dim, bool(keepdim))

    build.__name__ = kind
    return build


def _amax(kind: str):
    def build(input, dim=(), keepdim=False):
        if dim in ((), []):
            return Rejected(f"a{kind} over every dim")
        return ReduceOp(kind, input, dim, bool(keepdim))

    build.__name__ = f"a{kind}"
    return build


def _max_or_min(kind: str):
    """torch.max/min: over a dim (values, indices), against another tensor, or over everything."""

    def build(input, other=None, keepdim=False, *, dim=None):
        if isinstance(other, Node) and dim is None:
            return PointwiseOp("maximum" if kind == "max" else "minimum", (input, other))
        dim = other if dim is None else dim
        if dim is None:
            return Rejected(f"{kind} over every dim")
        return ReduceOp(kind, input, dim, bool(keepdim), tuple_output=True)

    return build


def logsumexp(input, dim, keepdim=False):
    return ReduceOp("logsumexp", input, dim, bool(keepdim))


def _row_map(kind: str):
    def build(input, dim=None, _stacklevel=3, dtype=None):
        if dim is None:
            return Rejected(f"{kind} without dim")
        if dtype is not None:
            return Rejected(f"{kind} with dtype={dtype}")
        return ReduceOp(kind, input, dim)

    return build


def getitem(value, index):
    """``max(dim)[0]`` / ``.values`` is the reduction's value; anything else is not ours."""
    from . import lookup

    reduce = lookup(value) if isinstance(value, Node) else None
    if not (isinstance(reduce, ReduceOp) and reduce.tuple_output):
        return Rejected("indexing")
    return AliasOp(value) if index == 0 else Rejected(f"reads the indices of {reduce.kind}(dim)")


SPELLINGS = (
    spell(_reduction("sum"), torch.sum, "sum"),
    spell(_reduction("mean"), torch.mean, "mean"),
    spell(_amax("max"), torch.amax, "amax"),
    spell(_amax("min"), torch.amin, "amin"),
    spell(_max_or_min("max"), torch.max, "max"),
    spell(_max_or_min("min"), torch.min, "min"),
    spell(logsumexp, torch.logsumexp, "logsumexp"),
    spell(_row_map("softmax"), F.softmax, torch.softmax, "softmax"),
    spell(_row_map("log_softmax"), F.log_softmax, torch.log_softmax, "log_softmax"),
    spell(getitem, operator.getitem),
)
