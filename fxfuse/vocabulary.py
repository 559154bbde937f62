"""The pointwise vocabulary: one row per function a Pointwise stage can call.

A row names the function as it appears in the IR's string form, the torch reference (the CPU kernel
and the test oracle: it is eager PyTorch itself, so NaN/Inf behaviour is eager's by construction),
the CUDA device function the code generator emits a call to, and the scalar attributes that follow
the operand (a slope, bounds, ...). Arithmetic (+ - * / and powers) is plain sympy and needs no row.

Adding an activation is one row here, one spelling in ``fxfuse.patterns`` and one device function
in ``csrc/epilogue_ops.cuh`` with its derivative beside it (``<device_fn>_bwd``, and
``<device_fn>_bwd_other`` for a second operand: eager's CUDA backward formula).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import sympy
import torch
import torch.nn.functional as F


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


@dataclass(frozen=True)
class PointwiseFn:
    """One function of the pointwise vocabulary."""

    name: str
    reference: Callable[..., torch.Tensor]  # (operand tensors..., *attrs) -> tensor
    device_fn: str  # the CUDA device function in csrc/epilogue_ops.cuh
    attrs: tuple[str, ...] = ()  # scalar attributes after the operands, in call order
    operands: int = 1  # tensor operands (2 for maximum/minimum against a parameter)

    @property
    def device_backward(self) -> tuple[str, ...]:
        """The device functions giving each operand's gradient, ``f(g, operands..., y, attrs...)``."""
        return (f"{self.device_fn}_bwd", f"{self.device_fn}_bwd_other")[: self.operands]


_ROWS = (
    PointwiseFn("relu", torch.relu, "fx_relu"),
    PointwiseFn("leaky_relu", F.leaky_relu, "fx_leaky_relu", ("negative_slope",)),
    PointwiseFn("gelu", F.gelu, "fx_gelu"),
    PointwiseFn("gelu_tanh", lambda x: F.gelu(x, approximate="tanh"), "fx_gelu_tanh"),
    PointwiseFn("silu", F.silu, "fx_silu"),
    PointwiseFn("sigmoid", torch.sigmoid, "fx_sigmoid"),
    PointwiseFn("tanh", torch.tanh, "fx_tanh"),
    PointwiseFn("mish", F.mish, "fx_mish"),
    PointwiseFn("clamp", torch.clamp, "fx_clamp", ("min", "max")),
    # clamp's forward, but eager's gradient: zero at the bounds themselves (hardtanh_backward)
    PointwiseFn("hardtanh", F.hardtanh, "fx_hardtanh", ("min_val", "max_val")),
    PointwiseFn("clamp_min", torch.clamp_min, "fx_clamp_min", ("min",)),
    PointwiseFn("clamp_max", torch.clamp_max, "fx_clamp_max", ("max",)),
    PointwiseFn("hardswish", F.hardswish, "fx_hardswish"),
    PointwiseFn("hardsigmoid", F.hardsigmoid, "fx_hardsigmoid"),
    PointwiseFn("elu", F.elu, "fx_elu", ("alpha",)),
    PointwiseFn("selu", F.selu, "fx_selu"),
    PointwiseFn("softplus", F.softplus, "fx_softplus", ("beta", "threshold")),
    PointwiseFn("abs", torch.abs, "fx_abs"),
    PointwiseFn("exp", torch.exp, "fx_exp"),
    PointwiseFn("maximum", torch.maximum, "fx_maximum", operands=2),
    PointwiseFn("minimum", torch.minimum, "fx_minimum", operands=2),
    # Rounding points: in a bfloat16/float16 chain eager rounds every op's result to the dtype;
    # the matcher marks each such point, so the fused kernel rounds where eager does.
    PointwiseFn("bf16", lambda x: _Round.apply(x, torch.bfloat16), "fx_round_bf16"),
    PointwiseFn("fp16", lambda x: _Round.apply(x, torch.float16), "fx_round_fp16"),
)

ROUNDING = {torch.bfloat16: "bf16", torch.float16: "fp16"}

POINTWISE: dict[str, PointwiseFn] = {row.name: row for row in _ROWS}


class EpilogueFunction(sympy.Function):
    """Base of the sympy functions that stand for vocabulary rows inside an expression."""

    row: PointwiseFn


def _make_function(row: PointwiseFn) -> type[EpilogueFunction]:
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
