"""Step 1: give every node of a Dynamo graph its canonical meaning, and functionalize in-place ops.

Floats Dynamo left symbolic that an op with a spelling reads become their values where that is
safe (patterns/symbolic_scalars.py: under ``dynamic=True``, and constants the graph computes).
Norms written out op by op (transformers' RMSNorms) become the norm op first
(patterns/written_norms.py); norms of order 1 and ±∞ the reductions of |y| they are, and softmin
the softmax of -y (patterns/reductions.py); ops that read only a value's dtype and device
(``new_empty``: timm's drop-path mask) factories that read nothing (patterns/shape_reads.py);
and a GEMM read only split in two halves (a gated MLP's one-GEMM spelling, a GLU) two GEMMs
(patterns/split_gemms.py). A pooling along the features, written as a pooling of the rows viewed
as one channel, becomes one node of the rows (patterns/feature_pooling.py); where its windows
reach past a row, the ``unsqueeze(1)`` carries the reason to stop a chain. The rotary embedding of
attention's heads becomes one node of the projection's rows, before the view into heads
(patterns/rotary.py).

Dynamo records ``y.mul_(3)`` as a node whose later readers still name ``y``: the mutation is
implicit in the node order. Where ``y`` is a fresh temporary, readers after the in-place node are
rewired to it, so that chains read as data flow and the in-place op can be fused as an out-of-place
one. An in-place op on anything else (a graph input, a view, a value with unknown readers) is
rejected, and the chain stops there.
"""

from __future__ import annotations

from torch.fx import Graph, Node

from . import patterns
from .patterns import feature_pooling, reductions, rotary, shape_reads, split_gemms, symbolic_scalars, written_norms
from .canonical import (AliasOp, CanonicalOp, GemmOp, NormOp, PointwiseOp, PoolOp, ReduceOp, Rejected, ReshapeOp,
                        RotaryOp, RowSelection)

FRESH_VALUE_OPS = (GemmOp, PointwiseOp, NormOp, ReduceOp, PoolOp, RotaryOp)  # they produce new tensors, not views


def canonicalize(graph: Graph) -> dict[Node, CanonicalOp]:
    """Canonical op of every node fxfuse has a spelling for (rewires in-place readers in place,
    and rewrites norms written out op by op into the norm op they compute)."""
    symbolic_scalars.specialize_floats(graph)
    written_norms.recognise(graph)
    reductions.recognise(graph)
    shape_reads.detach_from_values(graph)
    gemms = {node: op for node in graph.nodes if isinstance(op := _lookup(node), GemmOp)}
    split_gemms.split_in_two(graph, gemms)
    order = {node: i for i, node in enumerate(graph.nodes)}
    rejected: dict[Node, Rejected] = feature_pooling.recognise(graph)
    rotary.recognise(graph)
    for node in graph.nodes:  # in order, so chains of in-place ops rewire one after another
        op = _lookup(node)
        if isinstance(op, PointwiseOp) and op.inplace:
            reason = _functionalize(node, op, order)
            if reason is not None:
                rejected[node] = Rejected(reason)
    canon = {node: rejected.get(node) or _lookup(node) for node in graph.nodes}
    return {node: op for node, op in canon.items() if op is not None}


def _lookup(node: Node) -> CanonicalOp | None:
    return patterns.lookup(node) if node.op in ("call_function", "call_method") else None


def _functionalize(node: Node, op: PointwiseOp, order: dict[Node, int]) -> str | None:
    """Rewire the readers after ``node`` of the value it mutates; a reason when that is unsafe."""
    target = op.operands[0]
    target_op = _lookup(target) if isinstance(target, Node) else None
    if not isinstance(target_op, FRESH_VALUE_OPS) or (
        isinstance(target_op, ReduceOp) and target_op.tuple_output
    ):
        return "in-place op on a value that is not a fresh temporary"
    for user in target.users:
        if user is not node and not _reads_value_only(user):
            return f"in-place op on a value also used by {user.name} (maybe a view)"
    for user in [u for u in target.users if u is not node and order[u] > order[node]]:
        user.replace_input_with(target, node)
    return None


def _reads_value_only(user: Node) -> bool:
    """True when ``user`` cannot hold an alias of its input (so mutation is not observed there)."""
    op = _lookup(user)
    return user.op == "output" or (op is not None and not isinstance(op, (AliasOp, ReshapeOp, RowSelection, Rejected)))
