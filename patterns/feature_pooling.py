"""The pooling family: pooling along the feature dim, as KernelBench writes it —
``avg_pool1d(y.unsqueeze(1), k).squeeze(1)`` or ``max_pool1d`` (``nn.AvgPool1d`` / ``nn.MaxPool1d``)
of a 2-D value viewed as one channel, viewed back.

``recognise`` rewrites each such view-pool-view of a graph into one ``feature_pool`` node (a
function of the rows, as eager computes it, so a graph left to Inductor runs the same ops); its
spelling is the IR's Pool stage. Windows that reach past the row (padding, ceil mode) or skip
elements (dilation) are not taken: there the ``unsqueeze(1)`` carries the reason to stop a chain.
``FAMILY`` holds what the reference and the row kernels need of each kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.fx import Graph, Node

from ..canonical import PoolOp, Rejected, example_value
from . import spell


@dataclass(frozen=True)
class PoolFamily:
    """One pooling. ``torch_pool``: eager's 1-d pooling of a (rows, 1, n) value with a window and a
    stride; ``row_stage``: the row kernels' member function (csrc/row_core.cuh)."""

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


feature_pool.report_label = lambda rows, kind, kernel, stride: (  # as the user wrote it
    f"{kind}_pool1d({kernel})" if kernel == stride else f"{kind}_pool1d({kernel}, stride={stride})")


def pool(rows, kind, kernel, stride):
    return PoolOp(kind, rows, kernel, stride)


SPELLINGS = (spell(pool, feature_pool),)

# eager's 1-d poolings by FX target (F.max_pool1d is what Dynamo records for nn.MaxPool1d too)
_POOLS = {F.avg_pool1d: "avg", F.max_pool1d: "max", torch.max_pool1d: "max"}


def _avg_pool1d_args(input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True):
    return dict(locals(), dilation=1, return_indices=False)


def _max_pool1d_args(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False):
    return locals()


_ARGUMENTS = {"avg": _avg_pool1d_args, "max": _max_pool1d_args}  # eager's signatures, bound as eager binds them
_UNSQUEEZE = {"unsqueeze", torch.unsqueeze}
_SQUEEZE = {"squeeze", torch.squeeze}


def recognise(graph: Graph) -> dict[Node, Rejected]:
    """Rewrite every ``pool(y.unsqueeze(1)).squeeze(1)`` of a 2-D ``y`` whose windows lie inside
    the row into ``feature_pool(y, kind, kernel, stride)``; the ``unsqueeze(1)`` of the others,
    with the reason they stop a chain."""
    rejected = {}
    for node in list(graph.nodes):
        found = _pool_of_rows(node)
        if found is None:
            continue
        unsqueeze, kind, window, squeeze = found
        if isinstance(window, str):
            rejected[unsqueeze] = Rejected(f"{kind}_pool1d along the features (of {unsqueeze.name}): {window}")
            continue
        kernel, stride = window
        rows = unsqueeze.args[0]
        with graph.inserting_before(squeeze):
            pooled = graph.call_function(feature_pool, (rows, kind, kernel, stride))
        pooled.meta = dict(squeeze.meta)
        squeeze.replace_all_uses_with(pooled)
        for dead in (squeeze, node, unsqueeze):  # the last view first: each then has no readers left
            graph.erase_node(dead)
    return rejected


def _pool_of_rows(node: Node) -> tuple[Node, str, tuple[int, int] | str, Node] | None:
    """``(the unsqueeze, the kind, (kernel, stride) or why not, the squeeze)`` where ``node`` is a
    1-d pooling of a 2-D value viewed as one channel and viewed back."""
    if node.op != "call_function" or _POOLS.get(node.target) is None:
        return None
    kind = _POOLS[node.target]
    try:
        args = _ARGUMENTS[kind](*node.args, **node.kwargs)
    except TypeError:
        return None
    unsqueeze = args["input"]
    if not _is_view(unsqueeze, _UNSQUEEZE) or len(unsqueeze.users) != 1 or len(node.users) != 1:
        return None
    rows = example_value(unsqueeze.args[0])
    squeeze = next(iter(node.users))
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or _dim(unsqueeze) not in (1, -2):
        return None
    if not _is_view(squeeze, _SQUEEZE) or _dim(squeeze) not in (1, -2):
        return None
    return unsqueeze, kind, _window(kind, args, rows.shape[-1]), squeeze


def _window(kind: str, args: dict, n: int) -> tuple[int, int] | str:
    """(kernel, stride) of a pooling whose windows all lie inside a row of ``n``; else why not."""
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


def _is_view(node, targets: set) -> bool:
    return isinstance(node, Node) and node.op in ("call_function", "call_method") and node.target in targets


def _dim(view: Node):
    """The dim argument of an unsqueeze or squeeze node (None where it has none)."""
    if len(view.args) > 1:
        return view.args[1]
    return view.kwargs.get("dim")
