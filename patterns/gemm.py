"""GEMM spellings: F.linear / nn.Linear, addmm(b, x, W.t()) and addmm(b, x, W) with W stored
(K, N) (GPT-2's Conv1D), matmul / @ / mm with a transposed weight. A bias-free GEMM followed by ``+ vector`` is folded into the bias by the matcher."""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch.fx import Node

from ..canonical import GemmOp, RejectedGemm
from . import spell


def transposed_weight(node) -> Node | None:
    """W when ``node`` is W.T / W.t() / W.transpose(0, 1) / W.permute(1, 0) / torch.t(W)."""
    if not isinstance(node, Node):
        return None
    args = node.args
    if node.op == "call_function" and node.target is getattr and args[1:] in (("T",), ("mT",)):
        return args[0]
    if (node.op, node.target) in (("call_method", "t"), ("call_function", torch.t)):
        return args[0]
    if (node.op, node.target) in (("call_method", "transpose"), ("call_function", torch.transpose)):
        return args[0] if sorted(args[1:3]) in ([0, 1], [-2, -1], [-1, 0], [-2, 1]) else None
    if node.op == "call_method" and node.target == "permute":
        dims = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
        return args[0] if tuple(dims) == (1, 0) else None
    return None


def linear(input, weight, bias=None):
    return GemmOp(input, weight, bias)


def matmul(input, other):
    weight = transposed_weight(other)
    if weight is None:
        return RejectedGemm("matmul whose right operand is not a transposed (N, K) weight")
    return GemmOp(input, weight, None)


def addmm(input, mat1, mat2, *, beta=1, alpha=1):
    """``addmm(b, x, W.t())``, and GPT-2's Conv1D ``addmm(b, x, W)`` with W stored (K, N)."""
    if beta != 1 or alpha != 1:
        return RejectedGemm("addmm with beta or alpha other than 1")
    weight = transposed_weight(mat2)
    return GemmOp(mat1, mat2, input, weight_is_kn=True) if weight is None else GemmOp(mat1, weight, input)


SPELLINGS = (
    spell(linear, torch._C._nn.linear, F.linear),
    spell(matmul, torch.matmul, operator.matmul, torch.mm, "matmul", "mm", "__matmul__"),
    spell(addmm, torch.addmm),
)
