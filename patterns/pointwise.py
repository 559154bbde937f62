"""Pointwise spellings: arithmetic with scalars and parameters, dropout, identities, views and
casts (the activations are the function family's: patterns/functions.py)."""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from ..canonical import AliasOp, DropoutOp, PointwiseOp, Rejected, ReshapeOp, example_value
from . import spell


def add(input, other, *, alpha=1):
    if alpha != 1:
        return PointwiseOp("add", (input, other), (float(alpha),))
    return PointwiseOp("add", (input, other))


def sub(input, other, *, alpha=1):
    if alpha != 1:
        return Rejected("sub with alpha")
    return PointwiseOp("sub", (input, other))


def rsub(input, other, *, alpha=1):
    return Rejected("rsub with alpha") if alpha != 1 else PointwiseOp("sub", (other, input))


def mul(input, other):
    return PointwiseOp("mul", (input, other))


def div(input, other, *, rounding_mode=None):
    if rounding_mode is not None:
        return Rejected(f"division with rounding_mode={rounding_mode!r}")
    return PointwiseOp("div", (input, other))


def power(input, exponent):
    return PointwiseOp("pow", (input, exponent))


def rsqrt(input):  # torch.rsqrt: a power of -1/2 (its derivative, NaN and Inf are the power's)
    return PointwiseOp("pow", (input, -0.5))


def sqrt(input):
    return PointwiseOp("pow", (input, 0.5))


def square(input):
    return PointwiseOp("pow", (input, 2.0))


def reciprocal(input):  # torch.reciprocal: a power of -1
    return PointwiseOp("pow", (input, -1.0))


def neg(input):
    return PointwiseOp("neg", (input,))


def dropout(input, p=0.5, training=True, inplace=False):
    """Identity in eval mode or with p = 0; in training a random mask (a dropout stage)."""
    if not isinstance(p, (int, float)) or not isinstance(training, bool):
        return Rejected("dropout with a symbolic p or training flag")
    if p == 0 or not training:
        return AliasOp(input)
    if not 0 < p < 1:
        return Rejected(f"dropout with p={p}")
    if inplace:
        return Rejected("dropout with inplace=True in training mode")
    return DropoutOp(input, float(p))


def alpha_dropout(input, p=0.5, training=False, inplace=False):
    """``F.alpha_dropout`` / ``F.feature_alpha_dropout``: identity in eval mode or with p = 0 (in
    training, a mask of its own kind that the dropout stage does not draw)."""
    if not isinstance(p, (int, float)) or not isinstance(training, bool):
        return Rejected("alpha dropout with a symbolic p or training flag")
    if p == 0 or not training:
        return AliasOp(input)
    return Rejected("alpha dropout in training mode")


def identity(input, *args, **kwargs):
    return AliasOp(input)


def detach(input):
    """``x.detach()`` (KernelBench's ``x.clone().detach()``): the value itself where autograd
    records nothing; in a graph that records a backward it cuts the gradient, which a fused chain
    would not."""
    if getattr(example_value(input), "requires_grad", True):
        return Rejected("detach of a value autograd records (it cuts the gradient)")
    return AliasOp(input)


def flatten(input, start_dim=0, end_dim=-1):
    """``torch.flatten`` / ``x.flatten(1)``: a reshape (the matcher reads from the shapes whether it
    keeps the features last)."""
    return ReshapeOp(input)


def reshape(input, *shape):
    """``x.view(B, T, N)``, ``x.view(-1, N)``, ``x.reshape(...)``, ``torch.reshape(x, shape)``;
    not ``x.view(dtype)``, which reinterprets the bits."""
    if any(isinstance(s, torch.dtype) for s in shape):
        return Rejected("view as another dtype")
    return ReshapeOp(input)


CASTS = (torch.float32, torch.bfloat16, torch.float16)


def to(input, *args, dtype=None, non_blocking=False, copy=False, memory_format=None):
    """``x.to(torch.float32)`` / ``x.to(dtype=torch.bfloat16)``: the value in that dtype. The
    matcher reads the node's dtype: a cast to float32 widens a bfloat16/float16 chain (as where
    autocast or type promotion make an op compute in float32), a cast back to the chain's dtype
    after that rounds (a ``narrow()``), any other cast stops the chain. Moves are not epilogue ops."""
    if args:  # x.to(torch.float32); x.to(device), x.to(other), x.to(device, dtype) are no casts here
        target = args[0] if len(args) == 1 and dtype is None else None
    else:
        target = dtype
    if target in CASTS and memory_format is None:
        return AliasOp(input)
    return Rejected(f"to({', '.join(map(str, args)) or f'dtype={dtype}'}): not a cast between float types")


def type_as(input, other):
    """``x.type_as(other)``: ``x.to(other.dtype)``."""
    value = example_value(other)
    if not isinstance(value, torch.Tensor):
        return Rejected("type_as of a value without a dtype")
    return to(input, value.dtype)


SPELLINGS = (
    spell(add, operator.add, torch.add, "add", "__add__", "__radd__",
          inplace=(operator.iadd, "add_", "__iadd__")),
    spell(sub, operator.sub, torch.sub, torch.subtract, "sub", "subtract", "__sub__",
          inplace=(operator.isub, "sub_", "__isub__")),
    spell(rsub, torch.rsub, "__rsub__"),
    spell(mul, operator.mul, torch.mul, torch.multiply, "mul", "multiply", "__mul__", "__rmul__",
          inplace=(operator.imul, "mul_", "__imul__")),
    spell(div, operator.truediv, torch.div, torch.true_divide, torch.divide, "div", "divide",
          "true_divide", "__truediv__", inplace=(operator.itruediv, "div_", "__itruediv__")),
    spell(power, operator.pow, torch.pow, "pow", "__pow__", inplace=("pow_",)),
    spell(rsqrt, torch.rsqrt, "rsqrt", inplace=(torch.rsqrt_, "rsqrt_")),
    spell(sqrt, torch.sqrt, "sqrt", inplace=(torch.sqrt_, "sqrt_")),
    spell(square, torch.square, "square", inplace=("square_",)),
    spell(reciprocal, torch.reciprocal, "reciprocal", inplace=(torch.reciprocal_, "reciprocal_")),
    spell(neg, operator.neg, torch.neg, torch.negative, "neg", "negative", "__neg__",
          inplace=("neg_",)),
    spell(dropout, F.dropout),
    spell(alpha_dropout, F.alpha_dropout, F.feature_alpha_dropout),
    spell(identity, "contiguous", "clone", torch.clone),
    spell(reshape, "view", "reshape", torch.reshape),
    spell(flatten, "flatten", torch.flatten),
    spell(detach, "detach", torch.detach),
    spell(lambda input: to(input, torch.float32), "float"),  # x.float()
    spell(to, "to"),
    spell(type_as, "type_as"),
)
