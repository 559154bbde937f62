"""The derivative of a pointwise program as CUDA C: reverse mode over the forward's own temporaries.

The forward is printed exactly as the forward kernel prints it (fxfuse.cuda.printer), while a
tape records each temporary's primitive (``+``, ``*``, ``a * (1/c)``, a vocabulary call, ...). The
reverse sweep then walks the tape backwards and emits, for each primitive, the gradient formula
eager's autograd uses for it — ``grad * other`` for a product, ``-grad * ((a / b) / b)`` for a
quotient's divisor, the vocabulary's ``_bwd`` device functions (eager's CUDA backward kernels) for
calls — accumulating a value's gradient over all its uses (``x * sigmoid(x)``, ``x + x``).

Numerics: the forward values are eager's (a bfloat16/float16 chain keeps its rounding points, so
every mask, clamp bound and output-reading derivative sees eager's values), while the gradients
flow in float32 and are rounded once, when the kernel stores dY — as Inductor's derivative does.
Where the derivative runs once a row (the scalar function after a reduction, whose gradient every
element of the row then shares) ``round_gradients`` rounds the gradient at each rounding point as
eager's backward does: it costs nothing there, and a few units in the last place of that one
value would otherwise move the whole row's gradient together.
Eager's backward rounds each op's gradient to the dtype; repeating those roundings cost the kernel
half its time on the suite (a conversion instruction per rounding, at a quarter of the
arithmetic rate; BENCHMARKS.md section 6) and changes dY by at most a few units in the last
place of the dtype (within the 1e-2 tolerance of low-precision chains). Where each gradient op is
exact in the dtype (products by powers of two, masks) the result is eager's to the bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch

from .. import expr as E
from ..vocabulary import ROUNDING
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
    contribution and summed over the value's uses."""

    def __init__(self) -> None:
        self.grads: dict[str, str] = {}
        self.lines: list[str] = []
        self._count = 0

    def add(self, target, text: str) -> None:
        """Adds ``text`` to the gradient of ``target`` (constants have none)."""
        if not isinstance(target, _CValue):
            return
        name = target.text
        if name not in self.grads:
            grad = f"g_{name}"
            self.grads[name] = grad
            self.lines.append(f"float {grad} = {text};")
        else:
            grad = self.grads[name]
            self.lines.append(f"{grad} += {text};")

    def temp(self, text: str) -> str:
        name = f"r{self._count}"
        self._count += 1
        self.lines.append(f"const float {name} = {text};")
        return name


def print_gradient(expression: sympy.Expr, dtype: torch.dtype, num_params: int, x_name: str = "x",
                   round_gradients: bool = False) -> PrintedGradient:
    """The forward of ``expression`` (as the forward kernel computes it) and its reverse sweep;
    ``round_gradients``: the gradient rounded at each rounding point (module docstring).
    UnsupportedExpression where no derivative is printed (a tensor exponent)."""
    tape = _Tape(x_name)
    try:
        result = E.evaluate(expression, tape.symbol, tape.function)
    except (ZeroDivisionError, OverflowError) as error:
        raise UnsupportedExpression(f"constant arithmetic in {expression}: {error}") from None
    rounding = ROUNDING.get(dtype)
    roundings = {str(v) for v, op, operands in tape.ops if op == "call" and operands[0].row.name == rounding}
    # a backward that reads the output (sigmoid, tanh, exp, relu) reads the dtype's output in eager
    stored = {str(operands[1][0]): str(v) for v, op, operands in tape.ops if str(v) in roundings}
    reverse = _Reverse()
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
        elif op == "call" and str(value) in roundings:  # gradients stay float32 (module docstring)
            rounded = f"{operands[0].row.device_fn}({g})"  # the rounding point's own device function
            reverse.add(operands[1][0], rounded if round_gradients else g)
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

