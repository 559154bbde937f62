"""GEMM spellings: F.linear / nn.Linear, addmm(b, x, W.t()) and addmm(b, x, W) with W stored
(K, N) (GPT-2's Conv1D), matmul / @ / mm with a transposed weight or a 2-D one stored (K, N), and
einsum of the same forms. A bias-free GEMM followed by ``+ vector`` is folded into the bias by the
matcher. Batched matmuls of activations (bmm, baddbmm, matmul or einsum of two 3-D values) get a
report row with the reason."""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch.fx import Node

from ..canonical import GemmOp, Rejected, RejectedGemm, example_value
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


LAYOUT_METHODS = {"transpose", "permute", "swapaxes", "swapdims", "movedim", "moveaxis", "t"}
LAYOUT_FUNCTIONS = {torch.transpose, torch.permute, torch.swapaxes, torch.swapdims, torch.movedim, torch.moveaxis,
                    torch.t}


def moves_features(node: Node) -> bool:
    """``node`` permutes the dims of a value so that its last dim (the features) is no longer last:
    a transpose of the output (MLP-Mixer's token-mixing MLP), which the kernels cannot follow, as
    they write the GEMM's rows of N features."""
    if not isinstance(node, Node) or not node.args:
        return False
    layout = ((node.op == "call_method" and node.target in LAYOUT_METHODS)
              or (node.op == "call_function" and node.target in LAYOUT_FUNCTIONS)
              or (node.op == "call_function" and node.target is getattr and node.args[1:] in (("T",), ("mT",))))
    value, result = example_value(node.args[0]), example_value(node)
    if not layout or not isinstance(value, torch.Tensor) or not isinstance(result, torch.Tensor):
        return False
    return value.dim() >= 2 and value.stride(-1) == 1 and value.size(-1) > 1 and result.stride(-1) != 1


def transposed_for_gemms(node: Node) -> bool:
    """``node`` transposes a 2-D value (``transposed_weight``'s spellings) that only GEMMs and the
    graph's output read, directly or through moves to the device it is on (CLIP's
    ``matmul(text, image.t().to(device))``, its logits returned transposed): nothing is left for an
    epilogue, which ends a chain like a GEMM reading the value directly."""
    from . import lookup

    value = example_value(node.args[0]) if isinstance(node, Node) and node.args else None
    if transposed_weight(node) is None or not isinstance(value, torch.Tensor) or value.dim() != 2:
        return False
    readers, seen = list(node.users), set()
    while readers:
        reader = readers.pop()
        if reader in seen:
            continue
        seen.add(reader)
        if reader.op == "output" or (reader.op in ("call_function", "call_method")
                                     and isinstance(lookup(reader), GemmOp)):
            continue
        if _moves_to_its_own_device(reader):
            readers.extend(reader.users)
            continue
        return False
    return True


def _moves_to_its_own_device(node: Node) -> bool:
    """``v.to(device)`` where v is on that device already, its dtype kept: the same value."""
    if node.op != "call_method" or node.target != "to" or not node.args:
        return False
    before, after = example_value(node.args[0]), example_value(node)
    return (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor) and before.device == after.device
            and before.dtype == after.dtype)


def linear(input, weight, bias=None):
    return GemmOp(input, weight, bias)


def matmul(input, other):
    """``x @ W.T`` (a weight stored (N, K)), or ``x @ W`` with a 2-D W stored (K, N)."""
    weight = transposed_weight(other)
    if weight is not None:
        return GemmOp(input, weight, None)
    value = example_value(other)
    if getattr(value, "ndim", None) != 2:
        return RejectedGemm("a batched matmul: its right operand is not a 2-D weight")
    return GemmOp(input, other, None, weight_is_kn=True)


def bmm(input, mat2):
    return RejectedGemm("a batched matmul (bmm) of two 3-D values")


def baddbmm(input, batch1, batch2, *, beta=1, alpha=1):
    return RejectedGemm("a batched matmul (baddbmm) of two 3-D values")


def einsum(equation, *operands):
    """``einsum("...k,nk->...n", x, W)`` is ``x @ W.T``, ``"...k,kn->...n"`` is ``x @ W``;
    another contraction of two operands is a GEMM fxfuse does not take; anything else is no GEMM."""
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if not isinstance(equation, str) or len(operands) != 2 or equation.count("->") != 1:
        return Rejected("einsum other than of two operands with an explicit output")
    inputs, output = equation.replace(" ", "").split("->")
    left, _, right = inputs.partition(",")
    if len(left) >= 2 and len(right) == 2 and "." not in right:
        lead, k = left[:-1], left[-1]
        for weight_is_kn, n in ((False, right[0]), (True, right[1])):
            if right == (k + n if weight_is_kn else n + k) and n != k and n not in left and output == lead + n:
                return GemmOp(operands[0], operands[1], None, weight_is_kn=weight_is_kn)
    if (set(left) & set(right)) - set(output) - {"."}:
        return RejectedGemm(f"einsum {equation!r} is not a GEMM by a 2-D weight")
    return Rejected(f"einsum {equation!r} contracts nothing")


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
    spell(bmm, torch.bmm, "bmm"),
    spell(baddbmm, torch.baddbmm, "baddbmm"),
    spell(einsum, torch.einsum),
)
