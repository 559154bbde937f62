"""The rotary embedding (RoPE) of attention's queries and keys, as transformers writes it::

    q = proj(h).view(B, T, H, D).transpose(1, 2)            # heads of D features
    rotated = torch.cat((-q[..., D // 2:], q[..., :D // 2]), dim=-1)
    q_embed = q * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)  # cos, sin: (B or 1, T, D)

``recognise`` rewrites it into ``rotary_embedding(proj(h), cos, sin)`` on the projection's own
rows (B, T, H·D), then the same view into heads and transpose: the projection's chain then holds
the rotation (the IR's Rotary stage) and ends at the view, where attention reads it. The rotation
pairs column j of each head with column j ± D/2, so it is a row stage (its row kernel reads the
partner through the row's scratch); cos and sin are "head" operands, D values per row, the same
for every head of the row.
"""

from __future__ import annotations

import operator
from typing import Callable

import torch
from torch.fx import Graph, Node

from ..canonical import RotaryOp, example_value, view_as_in
from ..describe import LABEL
from . import spell


def rotate_heads(heads: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 rounded: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> torch.Tensor:
    """Each head (the last dim, D) of ``heads`` rotated as transformers' ``apply_rotary_pos_emb``
    rotates it, ``q * cos + cat(-q[D/2:], q[:D/2]) * sin``, with tables that broadcast against the
    heads; each product and the sum through ``rounded`` (the reference's rounding to the chain's
    dtype; none where eager's ops in eager's dtype round them)."""
    half = heads.shape[-1] // 2
    rotated = torch.cat((-heads[..., half:], heads[..., :half]), dim=-1)
    return rounded(rounded(heads * cos) + rounded(rotated * sin))


def rotary_embedding(rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Every head of D = cos.shape[-1] features of ``rows`` (..., H·D) rotated, with eager's ops in
    eager's order (the same values and roundings). ``cos`` and ``sin`` are (B, T, D) or (1, T, D)
    or (T, D) against rows (B, T, H·D)."""
    d = cos.shape[-1]
    heads = rows.unflatten(-1, (rows.shape[-1] // d, d))
    return rotate_heads(heads, cos.unsqueeze(-2), sin.unsqueeze(-2)).flatten(-2)


def rotary(rows, cos, sin):
    return RotaryOp(rows, cos, sin)


SPELLINGS = (spell(rotary, rotary_embedding),)

_TRANSPOSES = {"transpose", torch.transpose}
_MULS = {operator.mul, torch.mul, "mul"}
_ADDS = {operator.add, torch.add, "add"}
_NEGS = {operator.neg, torch.neg, "neg"}
_CATS = {torch.cat, torch.concat}


def recognise(graph: Graph) -> int:
    """Rewrite every rotary embedding of a projection's heads (the module docstring's form, either
    operand order of each product and the sum) into ``rotary_embedding`` of the projection's rows;
    the number rewritten."""
    count = 0
    for node in list(graph.nodes):
        found = _rotary_of_heads(node)
        if found is None:
            continue
        rows, view, transpose, cos, sin, dead = found
        rows_value, out_value = example_value(rows), example_value(node)
        with graph.inserting_before(node):
            cos_rows, sin_rows = (_per_row(graph, t) for t in (cos, sin))
            rotated = graph.call_function(rotary_embedding, (rows, cos_rows, sin_rows))
            heads = view_as_in(graph, rotated, view)
            out = graph.call_method("transpose", (heads, 1, 2))
        rotated.meta = {"example_value": out_value.new_empty(rows_value.shape), LABEL: "rotary_embedding"}
        heads.meta = {"example_value": out_value.new_empty(example_value(view).shape)}
        out.meta = dict(node.meta)
        node.replace_all_uses_with(out)
        for gone in [node, *dead, transpose, view]:  # readers first
            graph.erase_node(gone)
        count += 1
    return count


def _per_row(graph: Graph, table: Node) -> Node:
    """cos or sin as (B or 1, T, D) rows: the (B or 1, 1, T, D) table broadcast over the heads
    without its heads dim; a (T, D) table as it is."""
    if example_value(table).dim() == 2:
        return table
    squeezed = graph.call_method("squeeze", (table, 1))
    squeezed.meta = {"example_value": example_value(table).squeeze(1)}
    return squeezed


def _rotary_of_heads(add: Node):
    """``(rows, view, transpose, cos, sin, [the rotation's other nodes])`` where ``add`` is
    ``q * cos + cat(-q[..., D/2:], q[..., :D/2]) * sin`` of ``q = rows.view(B, T, H, D).transpose(1,
    2)`` with rows (B, T, H·D) read only there; None otherwise."""
    if not _calls(add, _ADDS) or len(add.args) != 2 or add.kwargs:
        return None
    for straight, turned in (add.args, add.args[::-1]):
        for q, cos in _factors(straight):
            for cat, sin in _factors(turned):
                found = _rotation(q, cos, cat, sin, straight)
                if found is not None:
                    rows, view, inner = found
                    return rows, view, q, cos, sin, [turned, cat, *inner, straight]
    return None


def _factors(node) -> list[tuple[Node, Node]]:
    """(a, b) and (b, a) of a product ``a * b`` read only by its one reader."""
    if not isinstance(node, Node) or not _calls(node, _MULS) or len(node.args) != 2 or node.kwargs:
        return []
    a, b = node.args
    if len(node.users) != 1 or not isinstance(a, Node) or not isinstance(b, Node):
        return []
    return [(a, b), (b, a)]


def _rotation(q: Node, cos: Node, cat: Node, sin: Node, product: Node):
    """``(rows, view, [neg, second half, first half])`` where ``cat`` rotates the halves of the
    heads ``q`` of ``rows`` (read only there and by ``product``, q * cos) and cos and sin are tables
    of (rows, D) broadcast over the heads."""
    if cat.op != "call_function" or cat.target not in _CATS or len(cat.users) != 1:
        return None
    args = {**dict(zip(("tensors", "dim"), cat.args)), **cat.kwargs}
    parts, dim = args.get("tensors"), args.get("dim", 0)
    heads = example_value(q)
    if not isinstance(heads, torch.Tensor) or heads.dim() != 4 or not isinstance(parts, (list, tuple)) or len(parts) != 2:
        return None
    b, h, t, d = heads.shape
    if dim not in (-1, 3) or d % 2 or not _is_table(cos, heads) or not _is_table(sin, heads):
        return None
    neg, first = parts
    if not (isinstance(neg, Node) and _calls(neg, _NEGS) and len(neg.users) == 1 and isinstance(first, Node)):
        return None
    second = neg.args[0]
    if not (_is_half(second, q, d // 2, d) and _is_half(first, q, 0, d // 2)):
        return None
    if set(q.users) != {first, second, product}:
        return None
    if not (_calls(q, _TRANSPOSES) and {_dim(q.args[1:], q.kwargs, 4, i) for i in (0, 1)} == {1, 2}):
        return None
    view = q.args[0]
    if not (isinstance(view, Node) and view.op == "call_method" and view.target in ("view", "reshape")
            and len(view.users) == 1 and isinstance(view.args[0], Node)):
        return None
    rows = view.args[0]
    value = example_value(rows)
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != (b, t, h * d) or len(rows.users) != 1:
        return None
    if tuple(example_value(view).shape) != (b, t, h, d):
        return None
    return rows, view, [neg, second, first]


def _is_table(table: Node, heads: torch.Tensor) -> bool:
    """cos or sin: (B or 1, 1, T, D) or (T, D) against heads (B, H, T, D), of the heads' dtype and
    device, not computed with a gradient (the chain does not give it one)."""
    value = example_value(table)
    if not isinstance(value, torch.Tensor) or value.dtype != heads.dtype or value.device != heads.device:
        return False
    if value.requires_grad:
        return False
    b, _, t, d = heads.shape
    shape = tuple(value.shape)
    return shape == (t, d) or (len(shape) == 4 and shape[0] in (1, b) and shape[1:] == (1, t, d))


def _is_half(node, q: Node, start: int, stop: int) -> bool:
    """``node`` is ``q[..., start:stop]`` read once."""
    if not isinstance(node, Node) or node.op != "call_function" or node.target is not operator.getitem:
        return False
    if node.args[0] is not q or len(node.users) != 1:
        return False
    index = node.args[1]
    if not isinstance(index, tuple) or len(index) != 2 or index[0] is not Ellipsis or not isinstance(index[1], slice):
        return False
    s = index[1]
    return s.step in (None, 1) and (s.start or 0) == start and s.stop in ((stop,) if start == 0 else (None, stop))


def _calls(node: Node, targets: set) -> bool:
    return node.op in ("call_function", "call_method") and node.target in targets


def _dim(args: tuple, kwargs: dict, ndim: int, i: int) -> int | None:
    names = ("dim0", "dim1")
    value = args[i] if i < len(args) else kwargs.get(names[i])
    return value % ndim if isinstance(value, int) else None
