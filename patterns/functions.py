"""The pointwise function family: one entry per activation a chain can call, everything fxfuse
knows of it.

An entry holds the function's name in the IR (``relu(x)``), its torch spellings (each ``build``
has the signature of the torch callable it stands for and returns the canonical op), eager's
function (the reference, and so the test oracle: NaN/Inf behaviour is eager's by construction), the
CUDA device function the code generators call and the scalar attributes that follow the operands.
fxfuse.vocabulary turns the entries into the sympy functions expressions are written in. Adding an
activation is an entry here plus its device function in ``csrc/epilogue_ops.cuh`` with its
derivative beside it (``<device_fn>_bwd``, and ``<device_fn>_bwd_other`` for a second operand:
eager's CUDA backward formula). Arithmetic (+ - * / and powers) is plain sympy and needs no entry.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from torch.fx import Node

from ..canonical import PointwiseOp, Rejected, example_value
from . import Spelling, spell


@dataclass(frozen=True)
class Activation:
    """One function of the pointwise vocabulary."""

    name: str
    reference: Callable[..., torch.Tensor]  # (operand tensors..., *attrs) -> tensor
    device_fn: str  # the CUDA device function in csrc/epilogue_ops.cuh
    attrs: tuple[str, ...] = ()  # scalar attributes after the operands, in call order
    operands: int = 1  # tensor operands (2 for maximum/minimum against a parameter)
    spellings: tuple[Spelling, ...] = ()  # none: reached through another's (gelu_tanh: gelu's)
    # False for a function with jumps (floor, sign, threshold): a step turns a last-bit difference
    # in its operand into a jump, so it must see eager's rounded GEMM output (the in-GEMM epilogue
    # reads the float32 accumulator and does not take it)
    continuous: bool = True
    # a comparison: its value in the graph is a bool tensor, which the expressions read as 1 or 0 (a
    # mask multiplied in, torch.where's condition); no gradient flows through it and a chain never
    # ends at it
    mask: bool = False

    @property
    def device_backward(self) -> tuple[str, ...]:
        """The device functions giving each operand's gradient, ``f(g, operands..., y, attrs...)``."""
        return (f"{self.device_fn}_bwd", f"{self.device_fn}_bwd_other")[: self.operands]


# -- spellings ------------------------------------------------------------------------------------


def _plain(name: str):
    """An activation without attributes: ``fn(input)``, ``F.fn(input, inplace=False)``."""

    def build(input, inplace=False):
        return PointwiseOp(name, (input,), inplace=bool(inplace))

    build.__name__ = name
    return build


def leaky_relu(input, negative_slope=0.01, inplace=False):
    return PointwiseOp("leaky_relu", (input,), (float(negative_slope),), bool(inplace))


def rrelu(input, lower=1.0 / 8, upper=1.0 / 3, training=False, inplace=False):
    """Outside training, a leaky ReLU of the mean slope (eager's rrelu then is one); in training
    each element draws its own slope."""
    if training:
        return Rejected("rrelu in training (a random slope an element)")
    return PointwiseOp("leaky_relu", (input,), ((float(lower) + float(upper)) / 2,), bool(inplace))


def torch_rrelu(input, lower=1.0 / 8, upper=1.0 / 3, training=False, generator=None):
    return rrelu(input, lower, upper, training)


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


def prelu(input, weight):
    """A weight of one value, or of one per feature of a 2-D value: torch's channel dim is dim 1,
    the features only where the value is 2-D."""
    value, slope = example_value(input), example_value(weight)
    if isinstance(value, torch.Tensor) and isinstance(slope, torch.Tensor) and slope.numel() != 1 and value.dim() != 2:
        return Rejected(f"prelu with a weight per channel of dim 1 of a {value.dim()}-D value (not its features)")
    return PointwiseOp("prelu", (input, weight))


class _PReLU(torch.autograd.Function):
    """torch.prelu elementwise (the weight broadcast as the chain's parameters are), with eager's
    backward: autograd through ``where(x > 0, x, w * x)`` would multiply a non-finite weight by
    the zero gradient of the branch not taken."""

    @staticmethod
    def forward(x, weight):
        return torch.where(x > 0, x, weight * x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        positive = x > 0
        dx = torch.where(positive, grad, weight * grad)
        dweight = torch.where(positive, torch.zeros_like(grad), x * grad)
        return dx.sum_to_size(x.shape), dweight.sum_to_size(weight.shape)


def _prelu(x, weight):
    return _PReLU.apply(x, weight)


def _zeros_like(like):
    return None if like is None else torch.zeros(like[0], dtype=like[1], device=like[2])


def _like(t):
    return (t.shape, t.dtype, t.device) if isinstance(t, torch.Tensor) else None


class _NoGradient(torch.autograd.Function):
    """A comparison's 0/1 value (``value``) as a function of its operands whose gradient is zero:
    eager's comparisons give its operands none."""

    @staticmethod
    def forward(value: torch.Tensor, *operands) -> torch.Tensor:
        return value.clone()

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # this form also works under torch.func
        ctx.likes = [_like(t) for t in inputs[1:]]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (None, *[_zeros_like(like) for like in ctx.likes])


class _Pick(torch.autograd.Function):
    """``value`` where ``condition`` is nonzero, else 0; the gradient to value where picked, none
    to the condition (as torch.where's)."""

    @staticmethod
    def forward(condition: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return torch.where(condition != 0, value, torch.zeros((), dtype=value.dtype, device=value.device))

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        condition, value = inputs
        ctx.save_for_backward(condition)
        ctx.likes = [_like(condition), _like(value)]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (condition,) = ctx.saved_tensors
        picked = torch.where(condition != 0, grad, torch.zeros((), dtype=grad.dtype, device=grad.device))
        return _zeros_like(ctx.likes[0]), picked.sum_to_size(ctx.likes[1][0])


def _float_of(*operands) -> torch.dtype:
    return next((t.dtype for t in operands if isinstance(t, torch.Tensor) and t.is_floating_point()), torch.float32)


def _predicate(compare):
    """A comparison as the expressions compute it: 1.0 where it holds, else 0.0 (NaN compares
    false), in the operands' float dtype, without a gradient."""
    def reference(a, b):
        value = compare(torch.as_tensor(a), torch.as_tensor(b)).to(_float_of(a, b))
        return _NoGradient.apply(value, *[t for t in (a, b) if isinstance(t, torch.Tensor)])

    return reference


def _pick(condition, value):
    """``value`` where ``condition`` (a comparison's 0/1) is nonzero, else 0: half of torch.where
    (``where(c, a, b) = pick(c, a) + pick(1 - c, b)``, which an infinite or NaN unpicked value
    never reaches); the gradient to value only."""
    dtype = _float_of(condition, value)
    return _Pick.apply(torch.as_tensor(condition, dtype=dtype), torch.as_tensor(value, dtype=dtype))


def compare(name: str):
    def build(input, other):
        if not isinstance(other, (Node, int, float)) or isinstance(other, bool):
            return Rejected(f"{name} with {other!r}")
        return PointwiseOp(name, (input, other))

    build.__name__ = name
    return build


def where(condition, input=None, other=None):
    if input is None or other is None:
        return Rejected("torch.where with only a condition (the nonzero indices)")
    return PointwiseOp("where", (condition, input, other))


def where_method(input, condition, other):  # y.where(c, other): torch.where(c, y, other)
    return where(condition, input, other)


def masked_fill(input, mask, value):
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return Rejected("masked_fill with a tensor value")
    return PointwiseOp("where", (mask, float(value), input))


def elu(input, alpha=1.0, inplace=False):
    return PointwiseOp("elu", (input,), (float(alpha),), bool(inplace))


def softplus(input, beta=1.0, threshold=20.0):
    return PointwiseOp("softplus", (input,), (float(beta), float(threshold)))


def celu(input, alpha=1.0, inplace=False):
    return PointwiseOp("celu", (input,), (float(alpha),), bool(inplace))


def threshold(input, threshold, value, inplace=False):
    return PointwiseOp("threshold", (input,), (float(threshold), float(value)), bool(inplace))


def hardshrink(input, lambd=0.5):
    return PointwiseOp("hardshrink", (input,), (float(lambd),))


def softshrink(input, lambd=0.5):
    return PointwiseOp("softshrink", (input,), (float(lambd),))


def round_(input, *, decimals=0):
    if decimals != 0:
        return Rejected(f"round with decimals={decimals}")
    return PointwiseOp("round", (input,))


def _method_and_function(name: str) -> Spelling:
    """``torch.<name>(x)``, ``x.<name>()`` and the in-place ``x.<name>_()`` / ``torch.<name>_(x)``."""
    inplace = tuple(t for t in (getattr(torch, f"{name}_", None), f"{name}_") if t is not None)
    return spell(_plain(name), getattr(torch, name), name, inplace=inplace)


FAMILY: tuple[Activation, ...] = (
    Activation("relu", torch.relu, "fx_relu",
               spellings=(spell(_plain("relu"), torch.relu, F.relu, "relu", inplace=(torch.relu_, "relu_")),)),
    Activation("leaky_relu", F.leaky_relu, "fx_leaky_relu", ("negative_slope",),
               spellings=(spell(leaky_relu, F.leaky_relu, torch._C._nn.leaky_relu,
                                inplace=(torch._C._nn.leaky_relu_,)),
                          spell(rrelu, F.rrelu, inplace=(F.rrelu_,)), spell(torch_rrelu, torch.rrelu))),
    Activation("gelu", F.gelu, "fx_gelu", spellings=(spell(gelu, F.gelu),)),
    Activation("gelu_tanh", lambda x: F.gelu(x, approximate="tanh"), "fx_gelu_tanh"),
    Activation("silu", F.silu, "fx_silu", spellings=(spell(_plain("silu"), F.silu),)),
    Activation("sigmoid", torch.sigmoid, "fx_sigmoid",
               spellings=(spell(_plain("sigmoid"), torch.sigmoid, F.sigmoid, "sigmoid", torch.special.expit,
                                inplace=(torch.sigmoid_, "sigmoid_")),)),
    Activation("tanh", torch.tanh, "fx_tanh",
               spellings=(spell(_plain("tanh"), torch.tanh, F.tanh, "tanh", inplace=(torch.tanh_, "tanh_")),)),
    Activation("mish", F.mish, "fx_mish", spellings=(spell(_plain("mish"), F.mish),)),
    Activation("clamp", torch.clamp, "fx_clamp", ("min", "max"),
               spellings=(spell(clamp, torch.clamp, torch.clip, "clamp", "clip",
                                inplace=(torch.clamp_, "clamp_", "clip_")),)),
    # clamp's forward, but eager's gradient: zero at the bounds themselves (hardtanh_backward)
    Activation("hardtanh", F.hardtanh, "fx_hardtanh", ("min_val", "max_val"),
               spellings=(spell(hardtanh, F.hardtanh, inplace=(F.hardtanh_,)), spell(relu6, F.relu6))),
    Activation("clamp_min", torch.clamp_min, "fx_clamp_min", ("min",),
               spellings=(spell(clamp_min, torch.clamp_min, "clamp_min", inplace=("clamp_min_",)),)),
    Activation("clamp_max", torch.clamp_max, "fx_clamp_max", ("max",),
               spellings=(spell(clamp_max, torch.clamp_max, "clamp_max", inplace=("clamp_max_",)),)),
    Activation("hardswish", F.hardswish, "fx_hardswish", spellings=(spell(_plain("hardswish"), F.hardswish),)),
    Activation("hardsigmoid", F.hardsigmoid, "fx_hardsigmoid",
               spellings=(spell(_plain("hardsigmoid"), F.hardsigmoid),)),
    Activation("elu", F.elu, "fx_elu", ("alpha",), spellings=(spell(elu, F.elu, inplace=(torch._C._nn.elu_,)),)),
    Activation("selu", F.selu, "fx_selu",
               spellings=(spell(_plain("selu"), F.selu, torch.selu, inplace=(torch.selu_,)),)),
    Activation("softplus", F.softplus, "fx_softplus", ("beta", "threshold"), spellings=(spell(softplus, F.softplus),)),
    Activation("abs", torch.abs, "fx_abs",
               spellings=(spell(_plain("abs"), torch.abs, operator.abs, "abs", "__abs__",
                                inplace=(torch.abs_, "abs_")),)),
    Activation("exp", torch.exp, "fx_exp",
               spellings=(spell(_plain("exp"), torch.exp, "exp", inplace=(torch.exp_, "exp_")),)),
    Activation("expm1", torch.expm1, "fx_expm1", spellings=(_method_and_function("expm1"), spell(_plain("expm1"), torch.special.expm1))),
    Activation("log", torch.log, "fx_log", spellings=(_method_and_function("log"),)),
    Activation("log1p", torch.log1p, "fx_log1p", spellings=(_method_and_function("log1p"), spell(_plain("log1p"), torch.special.log1p))),
    Activation("erf", torch.erf, "fx_erf", spellings=(_method_and_function("erf"), spell(_plain("erf"), torch.special.erf))),  # written-out GELU
    Activation("log_sigmoid", F.logsigmoid, "fx_log_sigmoid", spellings=(spell(_plain("log_sigmoid"), F.logsigmoid),)),
    # piecewise constant: the gradient is zero everywhere, as eager's
    Activation("sign", torch.sign, "fx_sign", spellings=(_method_and_function("sign"),), continuous=False),
    Activation("floor", torch.floor, "fx_floor", spellings=(_method_and_function("floor"),), continuous=False),
    Activation("ceil", torch.ceil, "fx_ceil", spellings=(_method_and_function("ceil"),), continuous=False),
    Activation("round", torch.round, "fx_round",
               spellings=(spell(round_, torch.round, "round", inplace=(torch.round_, "round_")),), continuous=False),
    Activation("trunc", torch.trunc, "fx_trunc", spellings=(_method_and_function("trunc"),), continuous=False),
    Activation("celu", F.celu, "fx_celu", ("alpha",), spellings=(spell(celu, F.celu, torch.celu, inplace=(F.celu_, torch.celu_)),)),
    Activation("threshold", F.threshold, "fx_threshold", ("threshold", "value"),
               spellings=(spell(threshold, F.threshold, torch.threshold, inplace=(F.threshold_, torch.threshold_)),),
               continuous=False),
    Activation("hardshrink", F.hardshrink, "fx_hardshrink", ("lambd",),
               spellings=(spell(hardshrink, F.hardshrink, torch.hardshrink, "hardshrink"),), continuous=False),
    Activation("softshrink", F.softshrink, "fx_softshrink", ("lambd",), spellings=(spell(softshrink, F.softshrink),)),
    Activation("maximum", torch.maximum, "fx_maximum", operands=2,
               spellings=(spell(maximum, torch.maximum, "maximum"),)),
    Activation("minimum", torch.minimum, "fx_minimum", operands=2,
               spellings=(spell(minimum, torch.minimum, "minimum"),)),
    Activation("prelu", _prelu, "fx_prelu", operands=2, spellings=(spell(prelu, torch.prelu, F.prelu),)),
    # softmax and log_softmax over one value (the size-1 dim a keepdim reduction left; reached
    # through the reduction family): 1 and 0, NaN where the value is not finite, as torch's
    Activation("softmax_of_one", lambda x: torch.softmax(x.unsqueeze(-1), -1).squeeze(-1), "fx_softmax_of_one"),
    Activation("log_softmax_of_one", lambda x: torch.log_softmax(x.unsqueeze(-1), -1).squeeze(-1),
               "fx_log_softmax_of_one"),
    # comparisons (1.0 or 0.0: a mask multiplied in, or torch.where's condition) and pick, which
    # torch.where and masked_fill are written in (the matcher: where(c, a, b) = pick(c, a) +
    # pick(1 - c, b))
    *(Activation(name, _predicate(fn), f"fx_{name}", operands=2, continuous=False, mask=True,
                 spellings=(spell(compare(name), op, fn, alias, name, alias.__name__),))
      for name, op, fn, alias in (("gt", operator.gt, torch.gt, torch.greater),
                                  ("ge", operator.ge, torch.ge, torch.greater_equal),
                                  ("lt", operator.lt, torch.lt, torch.less),
                                  ("le", operator.le, torch.le, torch.less_equal))),
    Activation("pick", _pick, "fx_pick", operands=2),
)

PREDICATES = tuple(row.name for row in FAMILY if row.mask)  # the comparisons

WHERE_SPELLINGS = (spell(where, torch.where), spell(where_method, "where"),
                   spell(masked_fill, torch.masked_fill, "masked_fill"))



# -- functions torch writes in others (Python functions in torch.nn.functional that Dynamo keeps as
# one call): their expressions over the vocabulary, as a registered activation's. The kernels
# compute the expression in float32 and round once where eager rounds each of its ops.


def _composite(name: str, expression: Callable[[], "sympy.Expr"]):
    def build(input):
        return PointwiseOp(name, (input,), expression=expression())

    build.__name__ = name
    return build


def _softsign():  # F.softsign: input / (input.abs() + 1)
    from .. import expr as E
    from ..vocabulary import call

    return E.div(E.X, E.add(call("abs", E.X), E.const(1.0)))


def _tanhshrink():  # F.tanhshrink: input - input.tanh()
    from .. import expr as E
    from ..vocabulary import call

    return E.sub(E.X, call("tanh", E.X))


COMPOSITES = (
    spell(_composite("softsign", _softsign), F.softsign),
    spell(_composite("tanhshrink", _tanhshrink), F.tanhshrink),
)

SPELLINGS = tuple(s for entry in FAMILY for s in entry.spellings) + COMPOSITES + WHERE_SPELLINGS
