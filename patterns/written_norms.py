"""Norms written out op by op, recognised as the norm they compute.

transformers' LlamaRMSNorm, Qwen2RMSNorm and T5LayerNorm compute an RMS norm by hand::

    v = h.to(torch.float32)
    r = torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    out = v * r            # T5: h * r, where h promotes to float32 against r

A layer norm written out (ConvNeXt's and many models' own LayerNorm) centres the row on its mean
and divides by the square root of its biased variance::

    u = x.mean(-1, keepdim=True)
    s = (x - u).pow(2).mean(-1, keepdim=True)      # or x.var(-1, keepdim=True, unbiased=False)
    out = (x - u) / torch.sqrt(s + eps)           # or (x - u) * torch.rsqrt(s + eps)

and becomes ``F.layer_norm(x, (N,), None, None, eps)`` (the weight and bias after it stay pointwise
ops). Where x is bfloat16/float16 the written norm rounds after every op and the norm rounds once
(more accurate: the correctness rule's float64 truth decides); under autocast, which runs
layer_norm in float32, only a float32 row is rewritten, so the output dtype stays eager's.

Likewise an instance norm of rows viewed as (B, 1, 1, N) (KernelBench) is the layer norm of the
rows it computes, and a row divided by its own Euclidean norm — CLIP's, ALIGN's and CLAP's
embeddings after their projection GEMMs::

    e = e / e.norm(p=2, dim=-1, keepdim=True)                               # ALIGN, CLAP
    e = e / torch.pow(torch.sum(torch.pow(e, 2), dim=-1, keepdim=True), 0.5)  # CLIP
    e = e / e.norm(dim=-1, keepdim=True).clamp(min=eps)                     # F.normalize's own form

is ``F.normalize(e, 2.0, -1, eps)`` (eps = 0 without the clamp: the same quotient, NaN on a row of
zeros as eager's).

A softmax written out with its max shift (numerically stable code that does not call softmax)::

    e = torch.exp(x - x.max(dim=-1, keepdim=True)[0])    # or .values, or x.amax(-1, keepdim=True)
    out = e / e.sum(dim=-1, keepdim=True)

is ``torch.softmax(x, -1)``, which shifts by the row's max itself (without the shift the written
form overflows where softmax does not, and is left as it is).

A row statistic read back against the row is no pointwise op and no single reduction, so the
matcher would stop at it. Here the product node becomes one ``torch.rms_norm(v, (N,), None, eps)``
node (the same float32 arithmetic: mean of squares, plus eps, reciprocal square root, times the
row), which the norm spellings then read like any other; the weight multiply after it stays a
pointwise op. Only a subgraph whose inner values (the square, the mean, the sum, the rsqrt) are
read by nothing else is rewritten, so no value the rest of the graph reads goes away.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch.fx import Graph, Node

from ..canonical import example_value

_MUL = {operator.mul, torch.mul, "mul"}
_ADD = {operator.add, torch.add, "add"}
_SUB = {operator.sub, torch.sub, "sub"}
_DIV = {operator.truediv, torch.div, torch.true_divide, "div", "true_divide"}
_RSQRT = {torch.rsqrt, "rsqrt"}
_SQRT = {torch.sqrt, "sqrt"}
_POW = {operator.pow, torch.pow, "pow"}
_MEAN = {torch.mean, "mean"}
_VAR = {torch.var, "var"}
_TO_FLOAT = {"to", "float"}
_EXP = {torch.exp, "exp"}
_SUM = {torch.sum, "sum"}
_AMAX = {torch.amax, "amax"}
_MAX = {torch.max, "max"}


def recognise(graph: Graph) -> int:
    """Rewrite every written-out RMS norm of ``graph`` into a ``torch.rms_norm`` node, every
    written-out layer norm and instance norm of rows in disguise into a ``layer_norm``, every
    row over its written-out Euclidean norm into ``F.normalize``, and every softmax written out
    with its max shift into ``torch.softmax``; how many."""
    found = (_instance_norms_of_rows(graph) + _written_layer_norms(graph) + _written_normalizations(graph)
             + _written_softmaxes(graph))
    for node in list(graph.nodes):
        match = _written_rms_norm(node)
        if match is None:
            continue
        row, eps, inner = match
        n = example_value(row).shape[-1]
        with graph.inserting_before(node):
            norm = graph.call_function(torch.rms_norm, (row, (int(n),), None, eps))
        norm.meta = dict(node.meta)
        node.replace_all_uses_with(norm)
        for dead in [node, *inner]:  # the product first: each then has no readers left
            graph.erase_node(dead)
        found += 1
    return found


_VIEWS = {"unsqueeze", "squeeze", "view", "reshape", torch.unsqueeze, torch.squeeze, torch.reshape}
_INSTANCE_NORM_ARGS = ("input", "running_mean", "running_var", "weight", "bias", "use_input_stats", "momentum", "eps")


def _instance_norms_of_rows(graph: Graph) -> int:
    """KernelBench's ``instance_norm(y.unsqueeze(1).unsqueeze(1)).squeeze(1).squeeze(1)``: an
    instance norm (no affine, no running statistics) of rows viewed as (B, 1, 1, N) normalises each
    row over its N values with biased variance — a layer norm of the rows. Where the views in and
    out are read by nothing else and the result is viewed back to the rows' shape, the views and
    the norm become ``F.layer_norm(y, (N,), eps=eps)``."""
    found = 0
    for node in list(graph.nodes):
        match = _instance_norm_of_rows(node)
        if match is None:
            continue
        row, eps, out, dead = match
        with graph.inserting_before(out):
            norm = graph.call_function(F.layer_norm, (row, (int(example_value(row).shape[-1]),), None, None, eps))
        norm.meta = dict(out.meta)
        out.replace_all_uses_with(norm)
        for node_ in dead:  # from the last view back: each then has no readers left
            graph.erase_node(node_)
        found += 1
    return found


def _instance_norm_of_rows(node: Node) -> tuple[Node, float, Node, list[Node]] | None:
    """``(rows, eps, the view back to the rows' shape, the nodes it replaces, last first)``."""
    if not _is(node, {F.instance_norm}) or len(node.args) > len(_INSTANCE_NORM_ARGS):
        return None
    args = {"running_mean": None, "running_var": None, "weight": None, "bias": None, "use_input_stats": True,
            "eps": 1e-5, **dict(zip(_INSTANCE_NORM_ARGS, node.args)), **node.kwargs}
    if any(args[k] is not None for k in ("running_mean", "running_var", "weight", "bias")):
        return None
    if args["use_input_stats"] is not True or not isinstance(args["eps"], (int, float)):
        return None
    views_in, row = [], args["input"]
    while _is(row, _VIEWS) and len(row.users) == 1:
        views_in.append(row)
        row = row.args[0]
    value, viewed = example_value(row), example_value(args["input"])
    if not views_in or not isinstance(value, torch.Tensor) or value.dim() not in (2, 3):
        return None
    if viewed.dim() < 3 or viewed.shape[-1] != value.shape[-1] or any(d != 1 for d in viewed.shape[2:-1]):
        return None  # each (sample, channel) must hold one row of N values
    views_out, out = [], node
    while tuple(example_value(out).shape) != tuple(value.shape):
        users = list(out.users)
        if len(users) != 1 or not _is(users[0], _VIEWS):
            return None
        out = users[0]
        views_out.append(out)
    if not views_out:
        return None
    return row, float(args["eps"]), out, [*reversed(views_out), node, *views_in]


def _is(node, targets: set) -> bool:
    return isinstance(node, Node) and node.op in ("call_function", "call_method") and node.target in targets


def _only_reader(node: Node, reader: Node) -> bool:
    return list(node.users) == [reader]


def _written_rms_norm(node: Node) -> tuple[Node, float, list[Node]] | None:
    """``(row, eps, inner nodes)`` when ``node`` is ``row * rsqrt(mean(row ** 2, -1, keepdim=True)
    + eps)`` (in either operand order, the row also as the value it was cast to float32 from)."""
    if not _is(node, _MUL) or len(node.args) != 2 or node.kwargs:
        return None
    for value, rsqrt in (node.args, node.args[::-1]):
        if not _is(rsqrt, _RSQRT) or not _only_reader(rsqrt, node):
            continue
        add = rsqrt.args[0] if rsqrt.args else None
        if not _is(add, _ADD) or not _only_reader(add, rsqrt) or add.kwargs:
            continue
        mean, eps = add.args if isinstance(add.args[1], (int, float)) else add.args[::-1]
        if not isinstance(eps, (int, float)) or not _is(mean, _MEAN) or not _only_reader(mean, add):
            continue
        if not _is_last_dim_mean(mean):
            continue
        square = mean.args[0]
        row = _squared(square)
        if row is None or not _only_reader(square, mean) or not _same_row(value, row, node):
            continue
        return row, float(eps), [rsqrt, add, mean, square]
    return None


def _is_last_dim_mean(mean: Node) -> bool:
    args = _last_dim_keepdim_args(mean, ("input", "dim", "keepdim"))
    return args is not None and args.get("dtype") is None


def _last_dim_keepdim_args(node: Node, positional: tuple[str, ...]) -> dict | None:
    """A row statistic's arguments by name (``positional``: its signature's leading names) where
    it is over the last dim of its input with keepdim=True; else None."""
    args = dict(zip(positional, node.args), **node.kwargs)
    return args if _is_last_dim(args.get("dim"), args.get("input")) and args.get("keepdim") is True else None


def _squared(square: Node) -> Node | None:
    """``v`` of ``v.pow(2)``, ``v ** 2`` or ``v * v``."""
    if _is(square, _POW) and len(square.args) == 2 and square.args[1] in (2, 2.0) and not square.kwargs:
        return square.args[0]
    if _is(square, _MUL) and len(square.args) == 2 and square.args[0] is square.args[1]:
        return square.args[0]
    return None


def _same_row(value, row: Node, product: Node) -> bool:
    """The product's row operand is the squared row itself, or the value the row is its float32
    cast of (T5: ``h * r`` with ``h.to(float32)`` squared): then the product computes in float32
    as the norm of the cast does. Both of the float tensors' last dim."""
    if value is not row:
        cast_from = row.args[0] if _is(row, _TO_FLOAT) and row.args else None
        if value is not cast_from or example_value(row).dtype != torch.float32:
            return False
    return _of_the_rows_shape_and_dtype(product, row)


def _of_the_rows_shape_and_dtype(result: Node, row: Node) -> bool:
    """``result`` is a float tensor of ``row``'s shape and dtype: replacing it by a norm of the row
    changes neither."""
    out, v = example_value(result), example_value(row)
    return (isinstance(out, torch.Tensor) and isinstance(v, torch.Tensor) and out.shape == v.shape
            and out.dtype == v.dtype and v.is_floating_point())


def _written_layer_norms(graph: Graph) -> int:
    """Rewrite every layer norm written out op by op (module docstring) into ``F.layer_norm``."""
    return _rewrite_float32_under_autocast(
        graph, _written_layer_norm,
        lambda row, eps: (F.layer_norm, (row, (int(example_value(row).shape[-1]),), None, None, eps)))


def _rewrite_float32_under_autocast(graph: Graph, match, call) -> int:
    """Replace each node ``match`` gives ``(row, eps, inner nodes, last first)`` for by the node
    ``call(row, eps)`` describes (a function and its arguments), the inner nodes erased; under
    autocast only a float32 row: autocast runs these norms in float32, where the written form of a
    bfloat16 row computes in bfloat16 and the replacement's output dtype would not be eager's."""
    found = 0
    for node in list(graph.nodes):
        match_ = match(node)
        if match_ is None:
            continue
        row, eps, inner = match_
        if not rewrite_keeps_dtypes(graph, row):
            continue
        function, args = call(row, eps)
        with graph.inserting_before(node):
            replacement = graph.call_function(function, args)
        replacement.meta = dict(node.meta)
        node.replace_all_uses_with(replacement)
        for dead in [node, *inner]:  # in reverse order of the graph: each then has no readers left
            graph.erase_node(dead)
        found += 1
    return found


def rewrite_keeps_dtypes(graph: Graph, row: Node) -> bool:
    """Whether ops rewritten into others compute ``row`` in the dtypes eager's ops do: outside
    autocast, or on a float32 row (autocast runs some ops in float32, and which differs between a
    written form and the op it is)."""
    value = example_value(row)
    autocast = any(getattr(n.target, "__name__", None) == "_enter_autocast" for n in graph.nodes)
    return value.dtype == torch.float32 or not (autocast or torch.is_autocast_enabled(value.device.type))


def _written_layer_norm(node: Node) -> tuple[Node, float, list[Node]] | None:
    """``(row, eps, inner nodes, last first)`` when ``node`` is ``(row - mean) / sqrt(var + eps)``,
    ``(row - mean) / (var + eps) ** 0.5`` or ``(row - mean) * rsqrt(var + eps)`` with ``mean`` the
    row's mean and ``var`` its biased variance over the last dim, its inner values read by nothing
    else, and the result of the row's shape and dtype."""
    if len(node.args) != 2 or node.kwargs:
        return None
    if _is(node, _DIV):
        candidates = [(node.args[0], node.args[1], _SQRT)]
    elif _is(node, _MUL):
        candidates = [(node.args[0], node.args[1], _RSQRT), (node.args[1], node.args[0], _RSQRT)]
    else:
        return None
    for numerator, scale, root_kind in candidates:
        root = _root_of(scale, root_kind)
        if root is None or not _only_reader(scale, node):
            continue
        add = root  # var + eps
        if not _is(add, _ADD) or add.kwargs or len(add.args) != 2 or not _only_reader(add, scale):
            continue
        var, eps = add.args if isinstance(add.args[1], (int, float)) else add.args[::-1]
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not isinstance(var, Node):
            continue
        row_mean = _centered(numerator)
        if row_mean is None:
            continue
        row, mean = row_mean
        variance_nodes = _biased_variance(var, row, mean, numerator)
        if variance_nodes is None or not _only_reader(var, add):
            continue
        inner = list(dict.fromkeys([scale, add, *variance_nodes, numerator]))
        centres = [n for n in inner if _centered(n) == (row, mean)]
        if any(not set(n.users) <= {node, *inner} for n in inner) or not set(mean.users) <= set(centres):
            continue  # an inner value read elsewhere: rewriting would take it away
        if not _of_the_rows_shape_and_dtype(node, row):
            continue
        return row, float(eps), _in_reverse_graph_order([*inner, mean])
    return None


def _root_of(scale: Node, root_kind: set) -> Node | None:
    """The radicand of ``sqrt(v)`` / ``v.sqrt()`` / ``v ** 0.5`` (root_kind _SQRT), or of
    ``rsqrt(v)`` (_RSQRT)."""
    if _is(scale, root_kind) and len(scale.args) == 1 and not scale.kwargs:
        return scale.args[0]
    if root_kind is _SQRT and _is(scale, _POW) and len(scale.args) == 2 and scale.args[1] == 0.5 and not scale.kwargs:
        return scale.args[0]
    return None


def _centered(node) -> tuple[Node, Node] | None:
    """``(row, mean)`` where ``node`` is ``row - mean`` and mean is the row's last-dim mean
    (keepdim)."""
    if not _is(node, _SUB) or len(node.args) != 2 or node.kwargs:
        return None
    row, mean = node.args
    if not isinstance(row, Node) or not _is(mean, _MEAN) or not _is_last_dim_mean(mean):
        return None
    return (row, mean) if mean.args[0] is row else None


def _biased_variance(var: Node, row: Node, mean: Node, numerator: Node) -> list[Node] | None:
    """The nodes computing ``var`` (``var`` first) where it is the row's biased variance over the
    last dim: the mean of the squared centred row (that centring ``numerator`` or another ``row -
    mean``), or ``row.var(-1, keepdim=True, unbiased=False)`` / ``correction=0``."""
    if _is(var, _VAR):
        args = _last_dim_keepdim_args(var, ("input", "dim", "unbiased", "keepdim"))
        biased = args is not None and (args.get("unbiased") is False or args.get("correction") in (0, 0.0))
        return [var] if biased and args.get("input") is row else None
    if not _is(var, _MEAN) or not _is_last_dim_mean(var):
        return None
    square = var.args[0]
    if not _only_reader(square, var):
        return None
    centred = _squared(square)
    if centred is not None:
        factors = [centred]
    elif _is(square, _MUL) and len(square.args) == 2 and not square.kwargs:  # (h - u) * (h - u), two nodes
        factors = list(square.args)
    else:
        return None
    if not all(f is numerator or _centered(f) == (row, mean) for f in factors):
        return None
    return [var, square, *(f for f in dict.fromkeys(factors) if f is not numerator)]


def _in_reverse_graph_order(nodes: list[Node]) -> list[Node]:
    order = {n: i for i, n in enumerate(nodes[0].graph.nodes)}
    return sorted(nodes, key=lambda n: order[n], reverse=True)


_CLAMP_MIN = {torch.clamp, torch.clamp_min, "clamp", "clamp_min"}


def _written_normalizations(graph: Graph) -> int:
    """Rewrite every row divided by its own Euclidean norm (module docstring) into ``F.normalize``."""
    return _rewrite_float32_under_autocast(graph, _written_normalization,
                                           lambda row, eps: (F.normalize, (row, 2.0, -1, eps)))


def _written_normalization(node: Node) -> tuple[Node, float, list[Node]] | None:
    """``(row, eps, the denominator's nodes, last first)`` when ``node`` is ``row / norm`` with norm
    the row's Euclidean norm over the last dim (keepdim; spelled as a norm, or as the square root of
    the sum of squares), possibly clamped below at eps, its values read by nothing else, and the
    quotient of the row's shape and dtype."""
    if not _is(node, _DIV) or len(node.args) != 2 or node.kwargs:
        return None
    row, denominator = node.args
    if not isinstance(row, Node) or not isinstance(denominator, Node) or not _only_reader(denominator, node):
        return None
    eps, norm, inner = 0.0, denominator, [denominator]
    clamped = _clamped_below(denominator)
    if clamped is not None:
        norm, eps = clamped
        if not _only_reader(norm, denominator):
            return None
        inner.append(norm)
    norm_nodes = _euclidean_norm_nodes(norm, row)
    if norm_nodes is None:
        return None
    if not _of_the_rows_shape_and_dtype(node, row):
        return None
    return row, eps, _in_reverse_graph_order(list(dict.fromkeys([*inner, *norm_nodes])))


def _clamped_below(node: Node) -> tuple[Node, float] | None:
    """``(v, eps)`` of ``v.clamp(min=eps)``, ``v.clamp_min(eps)`` and their torch functions (no
    upper bound, a number for eps)."""
    if not _is(node, _CLAMP_MIN) or not node.args:
        return None
    names = ("input", "min") if node.target in (torch.clamp_min, "clamp_min") else ("input", "min", "max")
    args = dict(zip(names, node.args), **node.kwargs)
    low = args.get("min")
    if args.get("max") is not None or isinstance(low, bool) or not isinstance(low, (int, float)):
        return None
    return args["input"], float(low)


def _euclidean_norm_nodes(norm: Node, row: Node) -> list[Node] | None:
    """The nodes computing ``norm`` (``norm`` first) where it is ``row``'s Euclidean norm over the
    last dim with keepdim: a norm spelling (``Tensor.norm``, ``torch.norm``,
    ``torch.linalg.vector_norm``, p = 2), or ``sqrt`` / ``** 0.5`` of the sum of the squared row,
    each inner value read by nothing else."""
    from . import lookup
    from ..canonical import ReduceOp

    op = lookup(norm)
    if isinstance(op, ReduceOp) and op.kind == "vector_norm":
        return [norm] if op.input is row and op.keepdim and _is_last_dim(op.dim, row) else None
    total = _root_of(norm, _SQRT)
    if total is None or not _only_reader(total, norm):
        return None
    op = lookup(total)
    if not isinstance(op, ReduceOp) or op.kind != "sum" or not op.keepdim or not _is_last_dim(op.dim, row):
        return None
    square = op.input
    if not isinstance(square, Node) or _squared(square) is not row or not _only_reader(square, total):
        return None
    return [norm, total, square]


def _is_last_dim(dim, row) -> bool:
    """``dim`` (an int or a one-element list) is ``row``'s last dim."""
    dim = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
    value = example_value(row)
    return isinstance(value, torch.Tensor) and not isinstance(dim, bool) and dim in (-1, value.dim() - 1)


def _written_softmaxes(graph: Graph) -> int:
    """Rewrite every softmax written out with its max shift (module docstring) into ``torch.softmax``."""
    return _rewrite_float32_under_autocast(graph, _written_softmax, lambda row, _: (torch.softmax, (row, -1)))


def _written_softmax(node: Node) -> tuple[Node, float, list[Node]] | None:
    """``(row, 0.0, inner nodes, last first)`` when ``node`` is ``e / e.sum(-1, keepdim=True)`` with
    ``e = exp(row - max)`` and max the row's own over the last dim (keepdim), its inner values read
    by nothing else, and the quotient of the row's shape and dtype."""
    if not _is(node, _DIV) or len(node.args) != 2 or node.kwargs:
        return None
    e, total = node.args
    if not _is(e, _EXP) or len(e.args) != 1 or e.kwargs or not _is(total, _SUM) or not _only_reader(total, node):
        return None
    args = _last_dim_keepdim_args(total, ("input", "dim", "keepdim"))
    if args is None or args.get("input") is not e or args.get("dtype") is not None or set(e.users) != {node, total}:
        return None
    shifted = e.args[0]
    if not _is(shifted, _SUB) or len(shifted.args) != 2 or shifted.kwargs or not _only_reader(shifted, e):
        return None
    row, peak = shifted.args
    peak_nodes = _row_max_nodes(peak, row) if isinstance(peak, Node) else None
    if peak_nodes is None or not _only_reader(peak, shifted) or not _of_the_rows_shape_and_dtype(node, row):
        return None
    return row, 0.0, _in_reverse_graph_order([total, e, shifted, *peak_nodes])


def _row_max_nodes(peak: Node, row: Node) -> list[Node] | None:
    """The nodes computing ``peak`` (``peak`` first) where it is ``row``'s max over the last dim with
    keepdim: ``amax(row, -1, keepdim=True)``, or ``max(row, -1, keepdim=True)`` taken at ``[0]`` /
    ``.values``."""
    if _is(peak, _AMAX):
        args = _last_dim_keepdim_args(peak, ("input", "dim", "keepdim"))
        return [peak] if args is not None and args.get("input") is row else None
    if peak.op != "call_function" or len(peak.args) != 2 or (peak.target, peak.args[1]) not in (
            (operator.getitem, 0), (getattr, "values")):
        return None
    pair = peak.args[0]
    if not _is(pair, _MAX) or not _only_reader(pair, peak):
        return None
    args = _last_dim_keepdim_args(pair, ("input", "dim", "keepdim"))
    return [peak, pair] if args is not None and args.get("input") is row else None
