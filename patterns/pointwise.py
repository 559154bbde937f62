"""Pointwise spellings: arithmetic with scalars and parameters, activations, identities."""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from ..canonical import AliasOp, DropoutOp, PointwiseOp, Rejected, ReshapeOp, example_value
from . import spell


def _unary(fn: str, *attrs: float):
    return PointwiseOp(fn, (), tuple(float(a) for a in attrs))


def _act(fn: str):
    """An activation without attributes: ``fn(input)``, ``F.fn(input, inplace=False)``."""

    def build(input, inplace=False):
        return PointwiseOp(fn, (input,), inplace=bool(inplace))

    build.__name__ = fn
    return build


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


def neg(input):
    return PointwiseOp("neg", (input,))


def leaky_relu(input, negative_slope=0.01, inplace=False):
    return PointwiseOp("leaky_relu", (input,), (float(negative_slope),), bool(inplace))


def gelu(input, approximate="none"):
    if approximate not in ("none", "tanh"):
        return Rejected(f"gelu approximate={approximate!r}")
    return PointwiseOp("gelu" if approximate == "none" else "gelu_tanh", (input,))


def hardtanh(input, min_val=-1.0, max_val=1.0, inplace=False):
    return PointwiseOp("hardtanh", (input,), (float(min_val), float(max_val)), bool(inplace))


def relu6(input, inplace=False):  # torch's relu6 is hardtanh(0, 6), gradient included
    return PointwiseOp("hardtanh", (input,), (0.0, 6.0), bool(inplace))


def clamp(input, min=None, max=None):
    if not all(v is None or isinstance(v, (int, float)) for v in (min, max)):
        return Rejected("clamp with tensor bounds")
    if min is None and max is None:
        return Rejected("clamp without bounds")
    if max is None:
        return PointwiseOp("clamp_min", (input,), (float(min),))
    if min is None:
        return PointwiseOp("clamp_max", (input,), (float(max),))
    return PointwiseOp("clamp", (input,), (float(min), float(max)))


def clamp_min(input, min):
    return clamp(input, min=min)


def clamp_max(input, max):
    return clamp(input, max=max)


def maximum(input, other):
    return PointwiseOp("maximum", (input, other))


def minimum(input, other):
    return PointwiseOp("minimum", (input, other))


def elu(input, alpha=1.0, inplace=False):
    return PointwiseOp("elu", (input,), (float(alpha),), bool(inplace))


def softplus(input, beta=1.0, threshold=20.0):
    return PointwiseOp("softplus", (input,), (float(beta), float(threshold)))


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


def identity(input, *args, **kwargs):
    return AliasOp(input)


def detach(input):
    """``x.detach()`` (KernelBench's ``x.clone().detach()``): the value itself where autograd
    records nothing; in a graph that records a backward it cuts the gradient, which a fused chain
    would not."""
    if getattr(example_value(input), "requires_grad", True):
        return Rejected("detach of a value autograd records (it cuts the gradient)")
    return AliasOp(input)


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
    spell(neg, operator.neg, torch.neg, torch.negative, "neg", "negative", "__neg__",
          inplace=("neg_",)),
    spell(_act("relu"), torch.relu, F.relu, "relu", inplace=(torch.relu_, "relu_")),
    spell(leaky_relu, F.leaky_relu, torch._C._nn.leaky_relu, inplace=(torch._C._nn.leaky_relu_,)),
    spell(gelu, F.gelu),
    spell(_act("silu"), F.silu),
    spell(_act("sigmoid"), torch.sigmoid, F.sigmoid, "sigmoid", inplace=(torch.sigmoid_, "sigmoid_")),
    spell(_act("tanh"), torch.tanh, F.tanh, "tanh", inplace=(torch.tanh_, "tanh_")),
    spell(_act("mish"), F.mish),
    spell(hardtanh, F.hardtanh, inplace=(F.hardtanh_,)),
    spell(relu6, F.relu6),
    spell(clamp, torch.clamp, torch.clip, "clamp", "clip", inplace=(torch.clamp_, "clamp_", "clip_")),
    spell(clamp_min, torch.clamp_min, "clamp_min", inplace=("clamp_min_",)),
    spell(clamp_max, torch.clamp_max, "clamp_max", inplace=("clamp_max_",)),
    spell(maximum, torch.maximum, "maximum"),
    spell(minimum, torch.minimum, "minimum"),
    spell(_act("hardswish"), F.hardswish),
    spell(_act("hardsigmoid"), F.hardsigmoid),
    spell(elu, F.elu, inplace=(torch._C._nn.elu_,)),
    spell(_act("selu"), F.selu, torch.selu, inplace=(torch.selu_,)),
    spell(softplus, F.softplus),
    spell(_act("abs"), torch.abs, operator.abs, "abs", "__abs__", inplace=(torch.abs_, "abs_")),
    spell(_act("exp"), torch.exp, "exp", inplace=(torch.exp_, "exp_")),
    spell(dropout, F.dropout),
    spell(identity, "contiguous", "clone", torch.clone),
    spell(reshape, "view", "reshape", torch.reshape),
    spell(detach, "detach", torch.detach),
    spell(lambda input: to(input, torch.float32), "float"),  # x.float()
    spell(to, "to"),
)
