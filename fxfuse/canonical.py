"""The canonical vocabulary: what each FX node of a Dynamo graph means to fxfuse.

``fxfuse.patterns`` maps the many spellings of an op (``F.leaky_relu``, ``nn.LeakyReLU``'s call, a
method, an in-place form, ``torch.addmm(b, x, W.t())`` ...) onto these few node meanings; the
matcher reads only these. Operands are FX nodes (tensors or symbolic scalars) or Python numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import sympy
import torch
from torch.fx import Node

Operand = Union[Node, float, int, bool, None]


def example_value(node) -> object:
    """The value Dynamo traced ``node`` with (a fake tensor), a dropout seed's meta tensor, or
    ``node`` itself if not a node."""
    if isinstance(node, DropoutSeed):
        return node.example
    if not isinstance(node, Node):
        return node
    return node.meta.get("example_value", node.meta.get("val"))


def view_as_in(graph, value: Node, view: Node) -> Node:
    """``value`` viewed as the graph's ``view`` node views its own input: the same call with the
    same size arguments (graph values where sizes are symbolic, not the sizes traced)."""
    return graph.create_node(view.op, view.target, (value, *view.args[1:]), dict(view.kwargs))


@dataclass(frozen=True)
class GemmOp:
    """``input @ weight.T + bias`` with ``weight`` of shape (N, K) — or, with ``weight_is_kn``,
    ``input @ weight + bias`` with ``weight`` stored (K, N) (GPT-2's Conv1D): the fused op then
    reads ``weight.t()``."""

    input: Node
    weight: Node
    bias: Node | None = None
    weight_is_kn: bool = False


@dataclass(frozen=True)
class PointwiseOp:
    """An elementwise op: arithmetic (add, sub, mul, div, pow, neg) or a vocabulary function.

    ``inplace`` marks the forms that mutate their first operand (``relu_``, ``inplace=True``).
    ``expression``: what a registered activation computes, in ``x`` (its one operand; ``fn``
    then only names it).
    """

    fn: str
    operands: tuple[Operand, ...]
    attrs: tuple[float, ...] = ()
    inplace: bool = False
    expression: sympy.Expr | None = None


@dataclass(frozen=True)
class NormOp:
    """group / layer / rms / batch normalisation as the torch function was called."""

    kind: str
    input: Node
    eps: float | None
    groups: int = 1
    normalized_shape: tuple | None = None
    weight: Node | None = None
    bias: Node | None = None
    running_mean: Node | None = None
    running_var: Node | None = None
    training: bool = False
    momentum: Operand = None


@dataclass(frozen=True)
class ReduceOp:
    """A reduction or row map over ``dim``; ``tuple_output`` for ``max(dim)``'s (values, indices)."""

    kind: str
    input: Node
    dim: Operand
    keepdim: bool = False
    tuple_output: bool = False
    eps: float | None = None  # normalize's
    correction: float | None = None  # var's and std's


@dataclass(frozen=True)
class PoolOp:
    """Pooling along the feature dim of a 2-D value (patterns/feature_pooling.py): windows of
    ``kernel`` values, ``stride`` apart, each inside the row."""

    kind: str  # "avg" or "max"
    input: Node
    kernel: int
    stride: int


@dataclass(frozen=True)
class RotaryOp:
    """The rotary embedding of a projection's rows (B, T, H·D) (patterns/rotary.py): each head of
    D = cos.shape[-1] features rotated by the (B or 1, T, D) or (T, D) tables ``cos`` and ``sin``."""

    input: Node
    cos: Node
    sin: Node


@dataclass(frozen=True)
class DropoutOp:
    """Dropout in training mode with 0 < p < 1 (random: each element kept with probability 1 - p)."""

    input: Node
    p: float


@dataclass(frozen=True, eq=False)
class DropoutSeed:
    """An operand of the fused op that is not in the graph yet: a dropout stage's seed, drawn on
    each call (the rewrite inserts the draw before the op). One per dropout node."""

    dropout: Node

    @property
    def example(self):
        """Its shape and dtype (two int64 values), as a meta tensor."""
        return torch.empty(2, dtype=torch.int64, device="meta")

    @property
    def device(self):
        return example_value(self.dropout).device


@dataclass(frozen=True)
class AliasOp:
    """The value of ``input`` unchanged (dropout in eval or with p=0, ``.values`` of max(dim))."""

    input: Node


@dataclass(frozen=True)
class ReshapeOp:
    """``input.view(...)`` / ``reshape``: the same values regrouped; the matcher takes it where
    it keeps the feature (last) dim and regroups only the rows."""

    input: Node


@dataclass(frozen=True)
class RowSelection:
    """``input[:, 0]``: whole rows of ``input`` picked by indexing its leading dims (BERT's and
    ViT's poolers take the first token). The chain's epilogue has nothing left to do there: like
    the next GEMM, it ends a chain that is fused in full."""

    input: Node


@dataclass(frozen=True)
class Rejected:
    """A spelling fxfuse knows but cannot fuse in this form; ``reason`` goes into the report."""

    reason: str


@dataclass(frozen=True)
class RejectedGemm(Rejected):
    """A GEMM spelling fxfuse cannot take in this form (``x @ W`` with W stored (K, N), a matmul
    of two activations): it still gets a report row of its own, with ``reason``."""


CanonicalOp = Union[GemmOp, PointwiseOp, NormOp, ReduceOp, PoolOp, RotaryOp, DropoutOp, AliasOp, ReshapeOp, RowSelection, Rejected]
