"""A GEMM whose output is only read split in two halves along the features, made two GEMMs.

The one-GEMM spelling of a gated MLP computes gate and up values with one weight and splits them:
``a, b = proj(x).chunk(2, dim=-1); silu(a) * b`` (also ``torch.chunk``, ``split(N, -1)``,
``split([N, N], -1)``). Each half is the GEMM of x with half of the weight's rows (and half of the
bias), so the GEMM becomes two: ``linear(x, W.narrow(0, 0, N), b.narrow(0, 0, N))`` and the same
from row N on. The halves are views of the one weight (gradients reach it as they reach the split's
halves), and the matcher then takes them as a gated pair: one fused op running both GEMMs.
``F.glu(proj(x), dim=-1)`` (``nn.GLU``) is that split with the first half times the sigmoid of
the second, and is rewritten so.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch.fx import Graph, Node

from ..canonical import GemmOp, example_value

CHUNKS = {("call_method", "chunk"), ("call_function", torch.chunk)}
SPLITS = {("call_method", "split"), ("call_function", torch.split)}
GLUS = {F.glu, torch._C._nn.glu}


def split_in_two(graph: Graph, gemms: dict[Node, GemmOp]) -> int:
    """Rewrite every GEMM of ``gemms`` read only through a split into two halves of its features
    into two GEMMs, one a half; how many."""
    found = 0
    for node, op in gemms.items():
        glu = _glu(node, op)
        if glu is not None:
            _split_glu(graph, node, op, glu)
            found += 1
            continue
        halves = _halves(node, op)
        if halves is None:
            continue
        with graph.inserting_before(node):
            for reader, half in zip(halves, _half_gemms(graph, node, op)):
                half.meta = dict(reader.meta)
                reader.replace_all_uses_with(half)
        split = next(iter(node.users))
        for reader in list(split.users):
            graph.erase_node(reader)
        graph.erase_node(split)
        graph.erase_node(node)
        found += 1
    return found


def _glu(node: Node, op: GemmOp) -> Node | None:
    """``node``'s only reader when it is a GLU along the features of an even width."""
    value = example_value(node)
    if op.weight_is_kn or len(node.users) != 1 or not isinstance(value, torch.Tensor) or value.dim() < 2:
        return None
    glu = next(iter(node.users))
    args = {**dict(zip(("input", "dim"), glu.args)), **glu.kwargs}
    dim = args.get("dim", -1)
    if (glu.op != "call_function" or glu.target not in GLUS or args.get("input") is not node
            or not isinstance(dim, int) or dim % value.dim() != value.dim() - 1
            or not isinstance(value.shape[-1], int) or value.shape[-1] % 2):
        return None
    return glu


def _split_glu(graph: Graph, node: Node, op: GemmOp, glu: Node) -> None:
    """``glu(linear(x, W, b))`` as ``linear(x, W₁, b₁) * sigmoid(linear(x, W₂, b₂))``, W₁ and W₂
    the halves of W's rows."""
    with graph.inserting_before(glu):
        halves = _half_gemms(graph, node, op)
        gate = graph.call_function(torch.sigmoid, (halves[1],))
        product = graph.call_function(torch.mul, (halves[0], gate))
    for new in (*halves, gate, product):
        new.meta = dict(glu.meta)  # each of the output's shape and dtype
    glu.replace_all_uses_with(product)
    graph.erase_node(glu)
    graph.erase_node(node)


def _halves(node: Node, op: GemmOp) -> tuple[Node, Node] | None:
    """The readers of the two halves (``getitem(split, 0)`` and ``(split, 1)``) when ``node``'s
    only reader splits it into two equal halves along its last dim and nothing reads the split
    but those; else None."""
    value = example_value(node)
    if op.weight_is_kn or len(node.users) != 1 or not isinstance(value, torch.Tensor) or value.dim() < 2:
        return None
    split = next(iter(node.users))
    n = value.shape[-1]
    if not isinstance(n, int) or n % 2 or split.args[:1] != (node,) or not splits_features(split):
        return None
    sections = _sections(split)
    if (split.op, split.target) in CHUNKS:
        two = sections == 2
    else:
        two = sections == n // 2 or (isinstance(sections, (list, tuple)) and list(sections) == [n // 2, n // 2])
    if not two:
        return None
    readers = {}
    for user in split.users:
        if user.op != "call_function" or user.target is not operator.getitem or user.args[1] not in (0, 1):
            return None
        if user.args[1] in readers:
            return None
        readers[user.args[1]] = user
    return (readers[0], readers[1]) if len(readers) == 2 else None


def splits_features(split: Node) -> bool:
    """``split`` is a chunk or split of a tensor along its last dim (the features)."""
    if (split.op, split.target) not in CHUNKS | SPLITS or not split.args:
        return False
    value = example_value(split.args[0])
    dim = _split_args(split).get("dim", 0)
    return isinstance(value, torch.Tensor) and isinstance(dim, int) and dim % value.dim() == value.dim() - 1


def _split_args(split: Node) -> dict:
    return {**dict(zip(("self", "sections", "dim"), split.args)), **split.kwargs}


def _sections(split: Node):
    """A chunk's count, or a split's size or sizes."""
    args = _split_args(split)
    return args.get("sections", args.get("chunks", args.get("split_size", args.get("split_size_or_sections"))))


def _half_gemms(graph: Graph, node: Node, op: GemmOp) -> list[Node]:
    """``linear(x, W.narrow(0, 0, N), b.narrow(0, 0, N))`` and the same from row N on, for
    ``node``'s GEMM of 2 N features (inserted where the graph is inserting)."""
    n = example_value(node).shape[-1] // 2
    halves = []
    for index in range(2):
        weight = _narrowed(graph, op.weight, index * n, n)
        bias = None if op.bias is None else _narrowed(graph, op.bias, index * n, n)
        halves.append(graph.call_function(F.linear, (op.input, weight, bias)))
    return halves


def _narrowed(graph: Graph, tensor: Node, start: int, length: int) -> Node:
    view = graph.call_function(torch.narrow, (tensor, 0, start, length))
    value = example_value(tensor)
    if isinstance(value, torch.Tensor):
        view.meta["example_value"] = value.narrow(0, start, length)
    return view
