"""Pooling along the feature dim, as KernelBench writes it: ``avg_pool1d(y.unsqueeze(1), k)`` or
``max_pool1d`` (``nn.AvgPool1d`` / ``nn.MaxPool1d``), then ``.squeeze(1)``.

No stage computes it yet (its output row is narrower than the GEMM's, which the kernels do not
take). The chain would stop at the ``unsqueeze(1)`` as "not an epilogue op"; here that node is
given the real blocker, the pooling, so the report names it.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch.fx import Graph, Node

from ..canonical import Rejected

_UNSQUEEZE = {"unsqueeze"}
_POOLS = {F.avg_pool1d: "avg_pool1d", F.max_pool1d: "max_pool1d", F.max_pool1d_with_indices: "max_pool1d"}


def _pool_after(node: Node) -> str | None:
    """The pooling's name where ``node`` is ``y.unsqueeze(1)`` read only by a 1-d pooling."""
    target = node.target if node.op == "call_method" else getattr(node.target, "__name__", None)
    if target not in _UNSQUEEZE or len(node.users) != 1:
        return None
    user = next(iter(node.users))
    if user.op == "call_module" or user.target not in _POOLS:
        return None
    return _POOLS[user.target]


def blockers(graph: Graph) -> dict[Node, Rejected]:
    """The ``unsqueeze(1)`` nodes before a pooling along the features, with the reason."""
    found = {}
    for node in graph.nodes:
        if node.op in ("call_method", "call_function") and (pool := _pool_after(node)) is not None:
            found[node] = Rejected(f"{pool} along the features (of {node.name}): pooling is not fused yet")
    return found
