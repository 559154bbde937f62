"""Activations of the user's own: a torch spelling and the expression it computes.

An op that Dynamo keeps as one call in the graph (a ``torch.library`` custom op, a function under
``torch._dynamo.allow_in_graph``, a builtin torch function fxfuse does not spell) ends a chain.
Registering what it computes, written over the pointwise vocabulary, lets it fuse::

    import fxfuse
    from fxfuse.patterns.activations import fn

    fxfuse.register_activation(torch.ops.mylib.quick_gelu.default,
                               lambda x: x * fn.sigmoid(1.702 * x))

The expression is all the back ends need: the reference evaluates it (so the fused op's values are
the expression's, not the registered op's; the two must agree), the kernels compute it in float32
and round once, as eager rounds the op's output, and its derivative is the expression's. Python
functions written in torch ops need no registration: Dynamo traces through them.
"""

from __future__ import annotations

from typing import Callable

import sympy
import torch

from .. import expr as E
from ..canonical import PointwiseOp
from ..vocabulary import POINTWISE, ROUNDING, EpilogueFunction, call

from . import Spelling, spell

Number = (int, float)


class Value:
    """A symbolic value in a registered activation's expression: arithmetic builds the expression
    as written (unevaluated, as the matcher builds chains), ``fn.<name>`` calls the vocabulary."""

    __slots__ = ("expr",)

    def __init__(self, expr: sympy.Expr) -> None:
        self.expr = expr

    def __add__(self, other): return Value(E.add(self.expr, _expr(other)))
    def __radd__(self, other): return Value(E.add(_expr(other), self.expr))
    def __sub__(self, other): return Value(E.sub(self.expr, _expr(other)))
    def __rsub__(self, other): return Value(E.sub(_expr(other), self.expr))
    def __mul__(self, other): return Value(E.mul(self.expr, _expr(other)))
    def __rmul__(self, other): return Value(E.mul(_expr(other), self.expr))
    def __truediv__(self, other): return Value(E.div(self.expr, _expr(other)))
    def __rtruediv__(self, other): return Value(E.div(_expr(other), self.expr))
    def __pow__(self, other): return Value(E.power(self.expr, _expr(other)))
    def __neg__(self): return Value(E.neg(self.expr))


def _expr(operand) -> sympy.Expr:
    if isinstance(operand, Value):
        return operand.expr
    if isinstance(operand, Number) and not isinstance(operand, bool):
        return E.const(operand)
    raise TypeError(f"an activation's expression takes values and numbers, not {type(operand).__name__}")


class _Functions:
    """``fn.relu(x)``, ``fn.clamp(x, 0.0, 6.0)``, ...: the vocabulary's functions on values (tensor
    operands first, then the function's scalar attributes, as torch orders them)."""

    def __getattr__(self, name: str) -> Callable[..., Value]:
        row = POINTWISE.get(name)
        if row is None or name in ROUNDING.values():
            raise AttributeError(f"{name!r} is not in fxfuse's pointwise vocabulary "
                                 f"({', '.join(n for n in POINTWISE if n not in ROUNDING.values())})")

        def apply(*args) -> Value:
            if len(args) != row.operands + len(row.attrs):
                raise TypeError(f"{name} takes {row.operands} operand(s) and the attributes {row.attrs}")
            operands = [_expr(a) for a in args[: row.operands]]
            attrs = [E.const(float(a)) for a in args[row.operands:]]
            return Value(call(name, *operands, *attrs))

        apply.__name__ = name
        return apply


fn = _Functions()
SPELLINGS: list[Spelling] = []  # what register_activation added, read by the spelling table


def register_activation(target, expression: Callable[[Value], Value], *, method: bool = False) -> None:
    """Fuse calls of ``target`` (a callable as it appears in Dynamo's graph, or with ``method`` a
    tensor method's name) on one tensor as ``expression`` of that tensor. Raises ValueError for a
    target fxfuse already spells and for an expression outside the vocabulary."""
    from . import lookup_table, reset_table

    if method != isinstance(target, str):
        raise ValueError("a method is named by a string, a function by the callable itself")
    targets = [target]  # a custom op appears in graphs as its packet or its default overload
    if isinstance(target, torch._ops.OpOverloadPacket):
        targets.append(target.default)
    elif isinstance(target, torch._ops.OpOverload) and target._overloadname == "default":
        targets.append(target.overloadpacket)
    for t in targets:
        if ("call_method" if method else "call_function", t) in lookup_table():
            raise ValueError(f"{t} is spelled already")
    result = expression(Value(E.X))
    if not isinstance(result, Value):
        raise ValueError(f"the expression returned {type(result).__name__}, not a value built from x")
    expr = result.expr
    strangers = {f for f in expr.atoms(sympy.Function) if not isinstance(f, EpilogueFunction)}
    if strangers or expr.free_symbols - {E.X}:
        raise ValueError(f"the expression reads {sorted(map(str, strangers | (expr.free_symbols - {E.X})))}, "
                         "outside x and fxfuse's vocabulary (use fn.<name>)")

    def build(input):
        return PointwiseOp(getattr(target, "__name__", str(target)), (input,), expression=expr)

    SPELLINGS.append(spell(build, *targets))
    reset_table()
