"""Pointwise expressions (fxfuse.expr trees) as CUDA C statements.

The printer evaluates a tree exactly as ``fxfuse.expr.evaluate`` does inside the reference, but
emits code instead of running torch ops, so the kernel computes what eager PyTorch computes on the
GPU for the same calls:

* operands are walked left to right like the evaluator (n-ary ``+``/``*`` fold from the left;
  ``Add(a, Mul(-1, b))`` is ``a - b``; ``Mul(a, Pow(b, -1))`` is ``a / b``);
* arithmetic between constants happens in Python (double), as the reference's Python floats do;
  only the result is rounded to float32 where it meets a tensor;
* ``tensor / constant`` is ``tensor * (1 / constant)`` in float32, as torch's CUDA division by a CPU
  scalar; ``constant / tensor`` is ``reciprocal(tensor) * constant`` (``Tensor.__rtruediv__``);
* ``tensor ** c`` takes torch's special cases (2, 3, 0.5, -1, -2, -0.5, 0, 1), else ``powf``;
* every composite node becomes one ``const float tK`` temporary, memoised by structure, so a value
  used twice (``x * sigmoid(x)``) is computed once.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

import sympy
import torch

from .. import expr as E
from ..vocabulary import EpilogueFunction


class UnsupportedExpression(ValueError):
    """The expression cannot be compiled (the chain should stay with the reference/Inductor)."""


Value = "float | str"  # a folded Python constant, or the name/text of a C float expression


def float32(value: float) -> float:
    """``value`` rounded to float32 (round to nearest even; overflow gives an infinity)."""
    if math.isnan(value) or math.isinf(value):
        return value
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def float_literal(value: float) -> str:
    """A C float literal equal to float32(value): Python's repr of the rounded value plus ``f``."""
    value = float32(float(value))
    if math.isnan(value):
        return "NAN"
    if math.isinf(value):
        return "INFINITY" if value > 0 else "(-INFINITY)"
    text = repr(value)
    if "e" not in text and "." not in text:
        text += ".0"
    literal = f"{text}f"
    return f"({literal})" if value < 0 or text.startswith("-") else literal


def float32_reciprocal(value: float) -> float:
    """1 / float32(value), rounded once in float32 (torch forms CUDA's ``a * (1 / b)`` this way)."""
    one = torch.tensor(1.0, dtype=torch.float32)
    return float(one / torch.tensor(float32(value), dtype=torch.float32))


@dataclass
class Printed:
    """C statements defining temporaries, the expression of the result, and the params used."""

    lines: list[str]
    result: str
    params: set[int] = field(default_factory=set)


class _Printer:
    def __init__(self, x_name: str, prefix: str) -> None:
        self.x_name = x_name
        self.prefix = prefix
        self.lines: list[str] = []
        self.memo: dict[sympy.Expr, Value] = {}
        self.params: set[int] = set()

    # -- values --------------------------------------------------------------------------------

    def temp(self, text: str) -> str:
        name = f"{self.prefix}{len(self.lines)}"
        self.lines.append(f"const float {name} = {text};")
        return name

    @staticmethod
    def c(value: Value) -> str:
        return float_literal(value) if isinstance(value, float) else value

    # -- the walk (mirrors fxfuse.expr.evaluate) --------------------------------------------------

    def value(self, e: sympy.Expr) -> Value:
        if isinstance(e, sympy.Symbol):
            if e == E.X:
                return self.x_name
            index = E.param_index(e)
            if index is None:
                raise UnsupportedExpression(f"unknown symbol {e.name!r}")
            self.params.add(index)
            return f"p{index}"
        if e.is_Number or e in (sympy.oo, -sympy.oo, sympy.nan):
            return float(e)
        if e in self.memo:
            return self.memo[e]
        result = self.composite(e)
        self.memo[e] = result
        return result

    def composite(self, e: sympy.Expr) -> Value:
        if isinstance(e, EpilogueFunction):
            return self.function(e)
        if isinstance(e, sympy.Add):
            acc = self.value(e.args[0])
            for term in e.args[1:]:
                if E.is_negation(term):
                    acc = self.binary(acc, "-", self.value(term.args[1]))
                else:
                    acc = self.binary(acc, "+", self.value(term))
            return acc
        if isinstance(e, sympy.Mul):
            if E.is_negation(e):
                return self.negate(self.value(e.args[1]))
            acc = self.value(e.args[0])
            for factor in e.args[1:]:
                if E.is_reciprocal(factor):
                    acc = self.binary(acc, "/", self.value(factor.args[0]))
                else:
                    acc = self.binary(acc, "*", self.value(factor))
            return acc
        if isinstance(e, sympy.Pow):
            return self.power(self.value(e.args[0]), self.value(e.args[1]))
        raise UnsupportedExpression(f"cannot print {sympy.srepr(e)}")

    def function(self, e: EpilogueFunction) -> Value:
        row = e.row
        operands = [self.c(self.value(a)) for a in e.args[: row.operands]]
        attrs = []
        for a in e.args[row.operands :]:
            if not (a.is_Number or a in (sympy.oo, -sympy.oo, sympy.nan)):
                raise UnsupportedExpression(f"{row.name}: attribute {a} is not a constant")
            attrs.append(float_literal(float(a)))
        return self.temp(f"{row.device_fn}({', '.join(operands + attrs)})")

    def binary(self, a: Value, op: str, b: Value) -> Value:
        if isinstance(a, float) and isinstance(b, float):
            return _fold(a, op, b)
        if op == "/" and isinstance(b, float):  # torch (CUDA): a * (1 / b), 1 / b in float32
            return self.temp(f"{a} * {float_literal(float32_reciprocal(b))}")
        if op == "/" and isinstance(a, float):  # Tensor.__rtruediv__: reciprocal(b) * a
            recip = self.temp(f"1.0f / {b}")
            return self.temp(f"{recip} * {float_literal(a)}")
        return self.temp(f"{self.c(a)} {op} {self.c(b)}")

    def negate(self, a: Value) -> Value:
        if isinstance(a, float):
            return -a
        return self.temp(f"-{a}")

    def power(self, base: Value, exponent: Value) -> Value:
        if isinstance(base, float) and isinstance(exponent, float):
            return _fold(base, "**", exponent)
        if isinstance(exponent, float):
            special = {
                0.0: "1.0f",
                1.0: f"{base}",
                2.0: f"{base} * {base}",
                3.0: f"{base} * {base} * {base}",
                0.5: f"sqrtf({base})",
                -0.5: f"1.0f / sqrtf({base})",
                -1.0: f"1.0f / {base}",
                -2.0: f"1.0f / ({base} * {base})",
            }
            if exponent in special:
                return self.temp(special[exponent])
        return self.temp(f"powf({self.c(base)}, {self.c(exponent)})")


def _fold(a: float, op: str, b: float) -> float:
    """Constant arithmetic as the reference's Python floats do it."""
    try:
        if op == "+":
            return a + b
        if op == "-":
            return a - b
        if op == "*":
            return a * b
        if op == "/":
            return a / b
        result = a**b
    except (ZeroDivisionError, OverflowError) as error:
        raise UnsupportedExpression(f"constant {a} {op} {b}: {error}") from None
    if not isinstance(result, float):
        raise UnsupportedExpression(f"constant {a} ** {b} is not a real number")
    return result


def print_expr(expression: sympy.Expr, x_name: str = "x", prefix: str = "t") -> Printed:
    """C statements computing ``expression`` with ``x`` named ``x_name``; temporaries are named
    ``<prefix><k>``, parameters ``p<i>`` (the caller declares them)."""
    printer = _Printer(x_name, prefix)
    result = printer.value(expression)
    return Printed(printer.lines, _Printer.c(result), printer.params)
