"""The derivative of a pointwise program as CUDA C: reverse mode over the forward's own temporaries.

The forward is printed exactly as the forward kernel prints it (fxfuse.cuda.printer), while a
tape records each temporary's primitive (``+``, ``*``, ``a * (1/c)``, a vocabulary call, ...). The
reverse sweep then walks the tape backwards and emits, for each primitive, the gradient formula
eager's autograd uses for it — ``grad * other`` for a product, ``-grad * ((a / b) / b)`` for a
quotient's divisor, the vocabulary's ``_bwd`` device functions (eager's CUDA backward kernels) for
calls — accumulating a value's gradient over all its uses (``x * sigmoid(x)``, ``x + x``).

Why reverse mode and not sympy's ``diff``: a bfloat16/float16 chain must round its gradients where
eager's backward rounds them. Eager hands each op a gradient of the dtype, so every gradient that
reaches a rounded value (a rounding point, the GEMM output, a parameter) is rounded, and a value
with several uses sums rounded gradients with a rounding after each addition. A symbolic derivative
would be one expression in float32 with none of those roundings; the reverse sweep reproduces them.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch

from .. import expr as E
from ..vocabulary import ROUNDING, EpilogueFunction
from .printer import (
    UnsupportedExpression,
    _CValue,
    _Printer,
    float32_reciprocal,
    float_literal,
    power_text,
)


@dataclass
class PrintedGradient:
    """C statements that, given ``x``, the output gradient ``g`` and the parameters ``p<i>``,
    assign ``dx`` (the gradient of x) and ``dp[i]`` for every parameter ``i < num_params``."""

    lines: list[str]
    params: set[int]  # parameters the statements read


class _Tape(_Printer):
    """The forward printer, recording every temporary's primitive and operands."""

    def __init__(self, x_name: str) -> None:
        super().__init__(x_name, "t")
        self.ops: list[tuple[_CValue, str, tuple]] = []

    def emit(self, text: str, op: str, operands: tuple) -> _CValue:
        value = self.temp(text)
        self.ops.append((value, op, operands))
        return value


class _Reverse:
    """Emits the reverse sweep: one ``float`` gradient a value, created at its first
    contribution; in a low-precision chain a contribution to a rounded value is rounded, and so is
    each sum of two contributions (eager adds dtype gradients)."""

    def __init__(self, rounding: str | None, rounded: set[str]) -> None:
        self.round_fn = None if rounding is None else f"fx_round_{rounding}"
        self.rounded = rounded  # C names of values of the dtype: x, parameters, rounding points
        self.grads: dict[str, str] = {}
        self.lines: list[str] = []
        self._count = 0

    def _round(self, name: str, text: str) -> str:
        return f"{self.round_fn}({text})" if self.round_fn and name in self.rounded else text

    def add(self, target, text: str) -> None:
        """Adds ``text`` to the gradient of ``target`` (constants have none)."""
        if not isinstance(target, _CValue):
            return
        name = target.text
        if name not in self.grads:
            grad = f"g_{name}"
            self.grads[name] = grad
            self.lines.append(f"float {grad} = {self._round(name, text)};")
        else:
            grad = self.grads[name]
            term = self.temp(self._round(name, text))
            self.lines.append(f"{grad} = {self._round(name, f'{grad} + {term}')};")

    def temp(self, text: str) -> str:
        name = f"r{self._count}"
        self._count += 1
        self.lines.append(f"const float {name} = {text};")
        return name


def print_gradient(expression: sympy.Expr, dtype: torch.dtype, num_params: int, x_name: str = "x") -> PrintedGradient:
    """The forward of ``expression`` (as the forward kernel computes it) and its reverse sweep.
    UnsupportedExpression where no derivative is printed (a tensor exponent)."""
    tape = _Tape(x_name)
    try:
        result = E.evaluate(expression, tape.symbol, tape.function)
    except (ZeroDivisionError, OverflowError) as error:
        raise UnsupportedExpression(f"constant arithmetic in {expression}: {error}") from None
    rounding = ROUNDING.get(dtype)
    rounded = {x_name} | {f"p{i}" for i in range(num_params)}
    roundings = {str(v): operands[1][0] for v, op, operands in tape.ops if op == "call" and _is_rounding(operands[0])}
    rounded |= set(roundings)
    # a backward that reads the output (sigmoid, tanh, exp, relu) reads the dtype's output in eager
    stored = {str(operand): name for name, operand in roundings.items()} if rounding else {}
    reverse = _Reverse(rounding, rounded)
    reverse.add(result, "g")
    c = _Printer.c
    for value, op, operands in reversed(tape.ops):
        g = reverse.grads.get(str(value))
        if g is None:  # nothing downstream reads it
            continue
        if op == "+":
            a, b = operands
            reverse.add(a, g)
            reverse.add(b, g)
        elif op == "-":
            a, b = operands
            reverse.add(a, g)
            reverse.add(b, f"-{g}")
        elif op == "*":
            a, b = operands
            reverse.add(a, f"{g} * {c(b)}")
            reverse.add(b, f"{g} * {c(a)}")
        elif op == "/":  # both tensors: grad / b, and -grad * ((a / b) / b)
            a, b = operands
            reverse.add(a, f"{g} / {b}")
            reverse.add(b, f"-{g} * (({a} / {b}) / {b})")
        elif op == "div_const":  # a / c on CUDA is a * (1 / c); so is grad / c
            a, b = operands
            reverse.add(a, f"{g} * {float_literal(float32_reciprocal(b))}")
        elif op == "reciprocal":  # -grad * (result * result)
            (b,) = operands
            reverse.add(b, f"-{g} * ({value} * {value})")
        elif op == "neg":
            reverse.add(operands[0], f"-{g}")
        elif op == "pow":
            base, exponent = operands
            if not isinstance(exponent, float) or not isinstance(base, _CValue):
                raise UnsupportedExpression("the derivative of a power with a tensor exponent")
            if exponent != 0.0:  # eager: exponent == 0 gives a zero gradient
                derivative = reverse.temp(f"{power_text(base, exponent - 1.0)} * {float_literal(exponent)}")
                reverse.add(base, f"{g} * {derivative}")
        elif op == "call":
            function, args = operands
            row = function.row
            tensors, attrs = args[: row.operands], [float_literal(a) for a in args[row.operands :]]
            output = stored.get(str(value), str(value))
            call_args = ", ".join([g, *(c(t) for t in tensors), output, *attrs])
            for operand, device_fn in zip(tensors, row.device_backward):
                reverse.add(operand, f"{device_fn}({call_args})")
        else:
            raise UnsupportedExpression(f"no derivative for {op!r}")
    outputs = [f"dx = {reverse.grads.get(x_name, '0.0f')};"]
    outputs += [f"dp[{i}] = {reverse.grads.get(f'p{i}', '0.0f')};" for i in range(num_params)]
    return PrintedGradient(tape.lines + reverse.lines + outputs, tape.params)


def _is_rounding(function: EpilogueFunction) -> bool:
    return function.row.name in ROUNDING.values()
