"""Pointwise expressions: build, print, parse and evaluate sympy trees without rewriting them.

Every tree is built unevaluated, so the user's arithmetic is kept exactly (``x / 10.0`` stays a
division, ``x + x`` stays an addition, ``x - x`` is not folded to 0 and still gives NaN for Inf).
Division is ``Mul(a, Pow(b, -1))`` and subtraction ``Add(a, Mul(-1, b))``, the shapes sympy itself
uses; the printer, the parser and the evaluators read them back as ``/`` and ``-``.

Symbols: ``x`` is the value entering the stage; ``p0, p1, ...`` are the program's parameters
(per-column vectors or scalars, fed to the fused op as tensors).
"""

from __future__ import annotations

import ast
import math
from typing import Callable

import sympy

from .vocabulary import SYMPY_FUNCTIONS, EpilogueFunction, call

X = sympy.Symbol("x")
MINUS_ONE = sympy.Integer(-1)


def param(index: int) -> sympy.Symbol:
    """The symbol of program parameter ``index``."""
    return sympy.Symbol(f"p{index}")


def param_index(symbol: sympy.Symbol) -> int | None:
    name = symbol.name
    return int(name[1:]) if name.startswith("p") and name[1:].isdigit() else None


def const(value: float) -> sympy.Expr:
    """A scalar literal; Python floats round-trip exactly (repr is printed)."""
    value = float(value)
    if math.isinf(value):
        return sympy.oo if value > 0 else -sympy.oo
    if math.isnan(value):
        return sympy.nan
    return sympy.Float(value)


def add(a: sympy.Expr, b: sympy.Expr) -> sympy.Expr:
    return sympy.Add(a, b, evaluate=False)


def neg(a: sympy.Expr) -> sympy.Expr:
    return sympy.Mul(MINUS_ONE, a, evaluate=False)


def sub(a: sympy.Expr, b: sympy.Expr) -> sympy.Expr:
    return sympy.Add(a, neg(b), evaluate=False)


def mul(a: sympy.Expr, b: sympy.Expr) -> sympy.Expr:
    return sympy.Mul(a, b, evaluate=False)


def div(a: sympy.Expr, b: sympy.Expr) -> sympy.Expr:
    return sympy.Mul(a, sympy.Pow(b, MINUS_ONE, evaluate=False), evaluate=False)


def power(a: sympy.Expr, b: sympy.Expr) -> sympy.Expr:
    return sympy.Pow(a, b, evaluate=False)


def substitute(expr: sympy.Expr, mapping: dict[sympy.Expr, sympy.Expr]) -> sympy.Expr:
    """Replace whole subtrees (symbols or calls) without re-evaluating anything: sympy's subs and
    xreplace rebuild nodes with evaluation, which would fold the user's arithmetic."""
    if expr in mapping:
        return mapping[expr]
    if not expr.args:
        return expr
    return expr.func(*(substitute(a, mapping) for a in expr.args), evaluate=False)


def without_calls(expr: sympy.Expr, names: set[str]) -> sympy.Expr:
    """``expr`` with every call of the vocabulary functions ``names`` replaced by its operand
    (the rounding points, for a kernel that computes in float32 and rounds once at the store);
    nothing else is rebuilt or re-evaluated."""
    if isinstance(expr, EpilogueFunction) and expr.row.name in names:
        return without_calls(expr.args[0], names)
    if not expr.args:
        return expr
    return expr.func(*(without_calls(a, names) for a in expr.args), evaluate=False)


def is_negation(expr: sympy.Expr) -> bool:
    return isinstance(expr, sympy.Mul) and len(expr.args) == 2 and expr.args[0] == MINUS_ONE


def is_reciprocal(expr: sympy.Expr) -> bool:
    return isinstance(expr, sympy.Pow) and expr.args[1] == MINUS_ONE


# ---------------------------------------------------------------------------------------------
# The string form: infix, fully parenthesised below the top level, floats printed with repr().


def to_string(expr: sympy.Expr) -> str:
    return _print(expr, top=True)


def _number(expr: sympy.Expr) -> str:
    if expr == sympy.oo:
        return "inf"
    if expr == -sympy.oo:
        return "-inf"
    if expr is sympy.nan:
        return "nan"
    return repr(float(expr))


def _print(expr: sympy.Expr, top: bool = False) -> str:
    wrap = (lambda s: s) if top else (lambda s: f"({s})")
    if isinstance(expr, sympy.Symbol):
        return expr.name
    if expr.is_Number or expr in (sympy.oo, -sympy.oo, sympy.nan):
        return _number(expr)
    if isinstance(expr, EpilogueFunction):
        return f"{type(expr).__name__}({', '.join(_print(a, top=True) for a in expr.args)})"
    if isinstance(expr, sympy.Add):
        text = _print(expr.args[0])
        for term in expr.args[1:]:
            text += f" - {_print(term.args[1])}" if is_negation(term) else f" + {_print(term)}"
        return wrap(text)
    if isinstance(expr, sympy.Mul):
        if is_negation(expr):
            return wrap(f"-{_print(expr.args[1])}")
        text = _print(expr.args[0])
        for factor in expr.args[1:]:
            text += f" / {_print(factor.args[0])}" if is_reciprocal(factor) else f" * {_print(factor)}"
        return wrap(text)
    if isinstance(expr, sympy.Pow):
        return wrap(f"{_print(expr.args[0])} ** {_print(expr.args[1])}")
    raise ValueError(f"cannot print {sympy.srepr(expr)}")


def parse(text: str) -> sympy.Expr:
    """Inverse of to_string."""
    return _parse(ast.parse(text, mode="eval").body)


_BINARY = {ast.Add: add, ast.Sub: sub, ast.Mult: mul, ast.Div: div, ast.Pow: power}


def _parse(node: ast.AST) -> sympy.Expr:
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_parse(node.left), _parse(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        if isinstance(node.operand, ast.Constant):
            return const(-float(node.operand.value))
        if isinstance(node.operand, ast.Name) and node.operand.id == "inf":
            return const(-math.inf)
        return neg(_parse(node.operand))
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return const(node.value)
    if isinstance(node, ast.Name):
        if node.id in ("inf", "nan"):
            return const(float(node.id))
        return sympy.Symbol(node.id)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        if node.func.id in SYMPY_FUNCTIONS:
            return call(node.func.id, *(_parse(a) for a in node.args))
    raise ValueError(f"not a pointwise expression: {ast.dump(node)}")


# ---------------------------------------------------------------------------------------------
# Evaluation over any value type that supports Python arithmetic (torch tensors, floats).


def evaluate(
    expr: sympy.Expr,
    symbols: Callable[[sympy.Symbol], object],
    function: Callable[[EpilogueFunction, list], object],
):
    """Evaluate ``expr`` in the order it was written, each distinct subtree once.

    ``symbols`` gives the value of a symbol; ``function`` applies a vocabulary function to its
    evaluated tensor operands followed by its scalar attributes (as floats). Values are anything with
    Python arithmetic: torch tensors in the reference, C expressions in the CUDA code generator.
    """
    memo: dict[sympy.Expr, object] = {}

    def ev(e: sympy.Expr):
        if isinstance(e, sympy.Symbol):
            return symbols(e)
        if e.is_Number or e in (sympy.oo, -sympy.oo, sympy.nan):
            return float(e)
        if e not in memo:
            memo[e] = composite(e)
        return memo[e]

    def composite(e: sympy.Expr):
        if isinstance(e, EpilogueFunction):
            n = e.row.operands
            return function(e, [ev(a) for a in e.args[:n]] + [float(a) for a in e.args[n:]])
        if isinstance(e, sympy.Add):
            value = ev(e.args[0])
            for term in e.args[1:]:
                value = value - ev(term.args[1]) if is_negation(term) else value + ev(term)
            return value
        if isinstance(e, sympy.Mul):
            if is_negation(e):
                return -ev(e.args[1])
            value = ev(e.args[0])
            for factor in e.args[1:]:
                value = value / ev(factor.args[0]) if is_reciprocal(factor) else value * ev(factor)
            return value
        if isinstance(e, sympy.Pow):
            return ev(e.args[0]) ** ev(e.args[1])
        raise ValueError(f"cannot evaluate {sympy.srepr(e)}")

    return ev(expr)
