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
* every composite node becomes one ``const float tK`` temporary; ``fxfuse.expr.evaluate`` visits
  each distinct subtree once, so a value used twice (``x * sigmoid(x)``) is computed once.
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
    """Emits one ``const float`` temporary per composite value; ``fxfuse.expr.evaluate`` does the
    walk (the reference's own, so the order of operations is the same) over ``_CValue``s."""

    def __init__(self, x_name: str, prefix: str) -> None:
        self.x_name = x_name
        self.prefix = prefix
        self.lines: list[str] = []
        self.params: set[int] = set()

    def temp(self, text: str) -> "_CValue":
        name = f"{self.prefix}{len(self.lines)}"
        self.lines.append(f"const float {name} = {text};")
        return _CValue(self, name)

    @staticmethod
    def c(value: Value) -> str:
        if isinstance(value, complex):
            raise UnsupportedExpression(f"constant {value} is not a real number")
        return float_literal(value) if isinstance(value, float) else str(value)

    def symbol(self, e: sympy.Symbol) -> "_CValue":
        if e == E.X:
            return _CValue(self, self.x_name)
        index = E.param_index(e)
        if index is None:
            raise UnsupportedExpression(f"unknown symbol {e.name!r}")
        self.params.add(index)
        return _CValue(self, f"p{index}")

    def emit(self, text: str, op: str, operands: tuple) -> "_CValue":
        """A temporary holding ``text``, the result of primitive ``op`` on ``operands`` (the
        gradient printer records these; here they only name the temporary)."""
        return self.temp(text)

    def function(self, e: EpilogueFunction, args: list) -> "_CValue":
        row = e.row
        operands = [self.c(a) for a in args[: row.operands]]
        attrs = [float_literal(a) for a in args[row.operands :]]
        return self.emit(f"{row.device_fn}({', '.join(operands + attrs)})", "call", (e, args))

    def binary(self, a: Value, op: str, b: Value) -> "_CValue":
        if op == "/" and isinstance(b, float):  # torch (CUDA): a * (1 / b), 1 / b in float32
            return self.emit(f"{a} * {float_literal(float32_reciprocal(b))}", "div_const", (a, b))
        if op == "/" and isinstance(a, float):  # Tensor.__rtruediv__: reciprocal(b) * a
            recip = self.emit(f"1.0f / {b}", "reciprocal", (b,))
            return self.emit(f"{recip} * {float_literal(a)}", "*", (recip, a))
        return self.emit(f"{self.c(a)} {op} {self.c(b)}", op, (a, b))

    def negate(self, a: Value) -> "_CValue":
        return self.emit(f"-{a}", "neg", (a,))

    def power(self, base: Value, exponent: Value) -> "_CValue":
        return self.emit(power_text(base, exponent), "pow", (base, exponent))


def power_text(base: Value, exponent: Value) -> str:
    """``base ** exponent`` as torch's CUDA pow computes it: its special exponents, else powf."""
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
            return special[exponent]
    return f"powf({_Printer.c(base)}, {_Printer.c(exponent)})"


class _CValue:
    """A C float expression; Python arithmetic on it emits temporaries (constants stay Python
    floats and fold in double, as the reference's Python floats do)."""

    def __init__(self, printer: _Printer, text: str) -> None:
        self.printer, self.text = printer, text

    def __str__(self) -> str:
        return self.text

    def __add__(self, other): return self.printer.binary(self, "+", other)
    def __radd__(self, other): return self.printer.binary(other, "+", self)
    def __sub__(self, other): return self.printer.binary(self, "-", other)
    def __rsub__(self, other): return self.printer.binary(other, "-", self)
    def __mul__(self, other): return self.printer.binary(self, "*", other)
    def __rmul__(self, other): return self.printer.binary(other, "*", self)
    def __truediv__(self, other): return self.printer.binary(self, "/", other)
    def __rtruediv__(self, other): return self.printer.binary(other, "/", self)
    def __neg__(self): return self.printer.negate(self)
    def __pow__(self, other): return self.printer.power(self, other)
    def __rpow__(self, other): return self.printer.power(other, self)


def print_expr(expression: sympy.Expr, x_name: str = "x", prefix: str = "t") -> Printed:
    """C statements computing ``expression`` with ``x`` named ``x_name``; temporaries are named
    ``<prefix><k>``, parameters ``p<i>`` (the caller declares them)."""
    printer = _Printer(x_name, prefix)
    try:
        result = E.evaluate(expression, printer.symbol, printer.function)
    except (ZeroDivisionError, OverflowError) as error:
        raise UnsupportedExpression(f"constant arithmetic in {expression}: {error}") from None
    return Printed(printer.lines, _Printer.c(result), printer.params)
