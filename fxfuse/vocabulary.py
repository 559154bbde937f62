"""The pointwise vocabulary: the functions a Pointwise stage's expression can call.

Its entries are the activation family's (``fxfuse.patterns.functions``: name, eager's reference,
device function, attributes, spellings) and the rounding points; each becomes a sympy function of
the same name, which expressions are written in, the printers print and the reference evaluates.
Arithmetic (+ - * / and powers) is plain sympy and needs no entry.
"""

from __future__ import annotations

import sympy
import torch

from .patterns.functions import FAMILY, Activation


class _Round(torch.autograd.Function):
    """x rounded to ``dtype`` and back. Its gradient is rounded too: eager's backward of a
    low-precision op hands a ``dtype`` gradient to the op before it, so the reference's backward
    (fxfuse.reference.backward) rounds where eager's does."""

    @staticmethod
    def forward(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return x.to(dtype).to(x.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # this form also works under torch.func
        ctx.dtype = inputs[1]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.dtype).to(grad.dtype), None


# Rounding points: in a bfloat16/float16 chain eager rounds every op's result to the dtype; the
# matcher marks each such point, so the fused kernel rounds where eager does.
_ROUNDINGS = (
    Activation("bf16", lambda x: _Round.apply(x, torch.bfloat16), "fx_round_bf16"),
    Activation("fp16", lambda x: _Round.apply(x, torch.float16), "fx_round_fp16"),
)
_ROWS = (*FAMILY, *_ROUNDINGS)

ROUNDING = {torch.bfloat16: "bf16", torch.float16: "fp16"}

POINTWISE: dict[str, Activation] = {row.name: row for row in _ROWS}


class EpilogueFunction(sympy.Function):
    """Base of the sympy functions that stand for vocabulary rows inside an expression."""

    row: Activation


def _make_function(row: Activation) -> type[EpilogueFunction]:
    return type(row.name, (EpilogueFunction,), {"nargs": row.operands + len(row.attrs), "row": row})


SYMPY_FUNCTIONS: dict[str, type[EpilogueFunction]] = {
    row.name: _make_function(row) for row in _ROWS
}


def is_rounding(expr: sympy.Expr, dtype: torch.dtype) -> bool:
    """``expr`` is a rounding point to ``dtype`` (the matcher marks them, the code generator reads
    them); never true in float32, which has none."""
    return isinstance(expr, EpilogueFunction) and expr.row.name == ROUNDING.get(dtype)


def call(name: str, *args: sympy.Expr) -> sympy.Expr:
    """The sympy call of vocabulary function ``name`` (never evaluated or simplified)."""
    return SYMPY_FUNCTIONS[name](*args, evaluate=False)
