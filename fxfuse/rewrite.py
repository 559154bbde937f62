"""Step 3: replace each matched chain by one call of the fused op.

A training-mode BatchNorm's running-statistics update stays visible in the graph as ordinary
in-place ops on the buffers, fed by the batch statistics the fused op returns, so Inductor sees
(and functionalizes) the mutation exactly as it would eager's.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Graph, Node

from .canonical import DropoutSeed, example_value, view_as_in
from .masks import SEED_HIGH
from .match import BatchNormUpdate, Chain, Fusion
from .patterns.gemm import transposed_weight

FUSED_OP = torch.ops.fxfuse.linear_epilogue.default


def rewrite(graph: Graph, chains: list[Chain]) -> None:
    replaced: dict[Node, Node] = {}  # a rewritten chain's last node -> the fused op's output
    for chain in chains:
        if chain.fusion is not None:
            replaced[chain.fusion.nodes[-1]] = _replace(graph, chain.fusion, chain.dtype, replaced)


def _replace(graph: Graph, fusion: Fusion, dtype: torch.dtype, replaced: dict[Node, Node]) -> Node:
    """The fused op in place of ``fusion``, whose GEMM outputs ``dtype``; its output. A fusion may
    read the value of an earlier rewritten chain (one fused block feeding the next GEMM):
    ``replaced`` maps it."""
    last = fusion.nodes[-1]
    x, weight, bias, *params = (replaced.get(a, a) for a in (fusion.x, fusion.weight, fusion.bias, *fusion.params))
    with graph.inserting_before(last.next):  # new nodes keep their creation order
        params = [_draw(graph, p) if isinstance(p, DropoutSeed) else p for p in params]
        if fusion.weight_is_kn:  # stored (K, N): the op takes the (N, K) view
            weight = graph.call_function(torch.t, (weight,))
        if fusion.casts_operands:  # autocast's casts of the GEMM operands, made explicit
            x, weight, bias = (None if a is None else graph.call_method("to", (a, dtype))
                               for a in (x, weight, bias))
            params = [graph.call_method("to", (p, dtype)) if i in fusion.program.second_gemms else p
                      for i, p in enumerate(params)]
        save_gemm = records_backward(fusion.gemm)
        fused = graph.call_function(FUSED_OP, (fusion.program.to_string(), x, weight, bias, params),
                                    {"save_gemm": save_gemm})
        out = _viewed(graph, graph.call_function(operator.getitem, (fused, 0)), fusion.view)
        if fusion.batch_norm_update is not None:
            _update_running_stats(graph, fused, fusion.batch_norm_update)
        if fusion.kept is not None:  # the value the graph also reads outside the chain
            kept = _viewed(graph, graph.call_function(operator.getitem, (fused, 3)), fusion.kept_view)
            fusion.kept.replace_all_uses_with(kept)
            replaced[fusion.kept] = kept
    last.replace_all_uses_with(out)
    gone = [*fusion.nodes, *fusion.second_gemms]  # the op runs the second GEMMs
    maybe_dead = {a for n in gone for a in n.all_input_nodes} - set(gone)
    for node in reversed(fusion.nodes):
        graph.erase_node(node)
    for node in fusion.second_gemms:
        graph.erase_node(node)
    for node in maybe_dead:  # W.t() / W.T views that only the GEMM read
        if not node.users and transposed_weight(node) is not None:
            graph.erase_node(node)
    return out


def _draw(graph: Graph, seed: DropoutSeed) -> Node:
    """A dropout stage's seed for this call: ``torch.randint`` in the graph, which Inductor lowers
    with torch's generator state (reproducible under ``torch.manual_seed``, advancing it as a
    random op does); the op saves it, so the backward drops the same elements."""
    return graph.call_function(torch.randint, (0, SEED_HIGH, (2,)),
                               {"device": seed.device, "dtype": torch.int64})


def _viewed(graph: Graph, value: Node, view: Node | None) -> Node:
    """``value`` (an output of the fused op, rows as x's) with its rows regrouped as ``view``, the
    chain's view node, regrouped the graph's value; ``value`` itself without one."""
    return value if view is None else view_as_in(graph, value, view)


def records_backward(node: Node) -> bool:
    """Whether Dynamo traced ``node``'s value as one autograd records (grad mode on and an input
    that requires grad): then the fused op keeps its GEMM output for the backward."""
    value = example_value(node)
    return isinstance(value, torch.Tensor) and value.requires_grad


def _update_running_stats(graph: Graph, fused: Node, update: BatchNormUpdate) -> None:
    """running = (1 - momentum) * running + momentum * batch_stat, as eager's batch_norm does
    (the variance being the unbiased one)."""
    stats = graph.call_method("detach", (graph.call_function(operator.getitem, (fused, 1)),))
    m = update.momentum
    keep = graph.call_function(operator.sub, (1.0, m)) if isinstance(m, Node) else 1.0 - m
    for index, running in enumerate((update.running_mean, update.running_var)):
        batch = graph.call_function(operator.getitem, (stats, index))
        graph.call_method("mul_", (running, keep))
        graph.call_method("add_", (running, graph.call_function(operator.mul, (batch, m))))
