"""The pooling family: pooling along the feature dim, as KernelBench writes it —
``avg_pool1d(y.unsqueeze(1), k).squeeze(1)`` or ``max_pool1d`` (``nn.AvgPool1d`` / ``nn.MaxPool1d``)
of a 2-D value viewed as one channel (or ``y[:, None]``, ``y.view(M, 1, N)``), viewed back
(``[:, 0]``, ``.view(M, -1)``, ``.flatten(1)``, ...).

``recognise`` rewrites each such view-pool-view of a graph into one ``feature_pool`` node (a
function of the rows, as eager computes it, so a graph left to Inductor runs the same ops); its
spelling is the IR's Pool stage. Windows that reach past the row (padding, ceil mode) or skip
elements (dilation) are not taken: there the view in carries the reason to stop a chain.
``FAMILY`` holds what the reference and the row kernels need of each kind.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.fx import Graph, Node

from ..canonical import PoolOp, Rejected, example_value
from ..describe import LABEL, describe
from . import spell


@dataclass(frozen=True)
class PoolFamily:
    """One pooling. ``torch_pool``: eager's 1-d pooling of a (rows, 1, n) value with a window and a
    stride; ``row_stage``: the row kernels' member function (csrc/row_pooling.cuh)."""

    kind: str
    torch_pool: Callable[[torch.Tensor, int, int], torch.Tensor]
    row_stage: str


FAMILY: dict[str, PoolFamily] = {entry.kind: entry for entry in (
    PoolFamily("avg", lambda v, k, s: F.avg_pool1d(v, k, s), "pool_avg"),
    PoolFamily("max", lambda v, k, s: F.max_pool1d(v, k, s), "pool_max"),
)}


def feature_pool(rows: torch.Tensor, kind: str, kernel: int, stride: int) -> torch.Tensor:
    """Each row of ``rows`` (..., n) pooled in windows of ``kernel`` values ``stride`` apart: what
    the recognised graph computes, as eager computes it."""
    n = rows.shape[-1]
    pooled = FAMILY[kind].torch_pool(rows.reshape(-1, 1, n), kernel, stride)
    return pooled.reshape(*rows.shape[:-1], pooled.shape[-1])


def pool(rows, kind, kernel, stride):
    return PoolOp(kind, rows, kernel, stride)


SPELLINGS = (spell(pool, feature_pool),)

def _avg_pool1d_args(input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True):
    return dict(locals(), dilation=1, return_indices=False)


def _max_pool1d_args(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False):
    return locals()


def _adaptive_pool1d_args(input, output_size, return_indices=False):
    return dict(locals(), kernel_size=None, stride=None, padding=0, dilation=1, ceil_mode=False)


# eager's 1-d poolings by FX target (F.max_pool1d is what Dynamo records for nn.MaxPool1d too): their
# kind, and their signatures, bound as eager binds them
_POOLS = {
    F.avg_pool1d: ("avg", _avg_pool1d_args),
    F.max_pool1d: ("max", _max_pool1d_args),
    torch.max_pool1d: ("max", _max_pool1d_args),
    F.adaptive_avg_pool1d: ("avg", _adaptive_pool1d_args),
    F.adaptive_max_pool1d: ("max", _adaptive_pool1d_args),
}
# views that take (M, N) rows to (M, 1, N) and (M, 1, L) back to (M, L), each keeping the row-major
# order of the values (which the shapes then pin down): unsqueeze(1), view, reshape, [:, None];
# squeeze(1), squeeze(), view, reshape, flatten(1), [:, 0]
_IN_VIEWS = {"unsqueeze", torch.unsqueeze, "view", "reshape", torch.reshape, operator.getitem}
_OUT_VIEWS = {"squeeze", torch.squeeze, "view", "reshape", torch.reshape, "flatten", torch.flatten, operator.getitem}


def recognise(graph: Graph) -> dict[Node, Rejected]:
    """Rewrite every ``pool(y.unsqueeze(1)).squeeze(1)`` of a 2-D ``y`` (or another view in and
    out, ``_IN_VIEWS`` / ``_OUT_VIEWS``) whose windows lie inside the row into ``feature_pool(y,
    kind, kernel, stride)``; the view in of the others, with the reason they stop a chain."""
    rejected = {}
    for node in list(graph.nodes):
        found = _pool_of_rows(node)
        if found is None:
            continue
        view_in, kind, window, view_out = found
        if isinstance(window, str):
            rejected[view_in] = Rejected(f"{kind}_pool1d along the features (of {view_in.name}): {window}")
            continue
        kernel, stride = window
        rows = view_in.args[0]
        with graph.inserting_before(view_out):
            pooled = graph.call_function(feature_pool, (rows, kind, kernel, stride))
        pooled.meta = {**view_out.meta, LABEL: _label(node, kernel, stride)}
        view_out.replace_all_uses_with(pooled)
        for dead in (view_out, node, view_in):  # the last view first: each then has no readers left
            graph.erase_node(dead)
    return rejected


def _pool_of_rows(node: Node) -> tuple[Node, str, tuple[int, int] | str, Node] | None:
    """``(the view in, the kind, (kernel, stride) or why not, the view out)`` where ``node`` is a
    1-d pooling of a 2-D value viewed as one channel and viewed back."""
    if node.op != "call_function" or _POOLS.get(node.target) is None:
        return None
    kind, arguments = _POOLS[node.target]
    try:
        args = arguments(*node.args, **node.kwargs)
    except TypeError:
        return None
    view_in = args["input"]
    if not isinstance(view_in, Node) or len(view_in.users) != 1 or len(node.users) != 1 or not view_in.args:
        return None
    rows, channel, pooled = example_value(view_in.args[0]), example_value(view_in), example_value(node)
    view_out = next(iter(node.users))
    back = example_value(view_out)
    if not all(isinstance(v, torch.Tensor) for v in (rows, channel, pooled, back)) or rows.dim() != 2:
        return None
    m, n = rows.shape
    if tuple(channel.shape) != (m, 1, n) or not _is_view(view_in, _IN_VIEWS):
        return None
    if tuple(back.shape) != (m, pooled.shape[-1]) or not _is_view(view_out, _OUT_VIEWS):
        return None
    return view_in, kind, _window(kind, args, n), view_out


def _label(node: Node, kernel: int, stride: int) -> str:
    """The report's name of the pooling: the user's function and its window (an adaptive one's
    output size)."""
    name = describe(node).split("(")[0]
    if _POOLS[node.target][1] is _adaptive_pool1d_args:
        return f"{name}({_one(_adaptive_pool1d_args(*node.args, **node.kwargs)['output_size'])})"
    return f"{name}({kernel})" if kernel == stride else f"{name}({kernel}, stride={stride})"


def _window(kind: str, args: dict, n: int) -> tuple[int, int] | str:
    """(kernel, stride) of a pooling whose windows all lie inside a row of ``n``; else why not."""
    if "output_size" in args:  # adaptive: L values from rows of N are windows of N / L where L divides N
        size = _one(args["output_size"])
        if not isinstance(size, int) or size < 1 or n % size:
            return f"an output of {args['output_size']!r} from rows of {n} (windows of unequal size) is not fused"
        args = dict(args, kernel_size=n // size)
    kernel, stride = _one(args["kernel_size"]), _one(args["stride"])
    stride = kernel if stride is None else stride
    if not isinstance(kernel, int) or not isinstance(stride, int) or kernel < 1 or stride < 1:
        return f"window {args['kernel_size']!r}, stride {args['stride']!r}"
    if kernel > n:
        return f"a window of {kernel} is wider than the row ({n})"
    if _one(args["padding"]) != 0:
        return f"padding {args['padding']!r} is not fused (windows past the row's ends)"
    if args["ceil_mode"] is not False and (n - kernel) % stride != 0:
        return "ceil_mode is not fused (a window past the row's end)"
    if _one(args["dilation"]) != 1 or args["return_indices"] is not False:
        return "dilation or return_indices is not fused"
    return kernel, stride


def _one(value):
    """An int given as itself or as a one-element tuple or list; None for None or empty."""
    if isinstance(value, (tuple, list)):
        return value[0] if len(value) == 1 else (None if not value else value)
    return value


def _is_view(node: Node, targets: set) -> bool:
    """``node`` calls one of ``targets``; an indexing only with ``:``, ``None`` and ``0`` (a view
    whose result the shapes pin down; a step or a range would pick other values)."""
    if node.op not in ("call_function", "call_method") or node.target not in targets:
        return False
    if node.target is not operator.getitem:
        return True
    index = node.args[1] if len(node.args) > 1 else None
    entries = index if isinstance(index, tuple) else (index,)
    return all(e is None or e == 0 or e == slice(None) for e in entries)
