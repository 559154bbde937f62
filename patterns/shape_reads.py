"""Ops that read only a value's dtype and device, made factories that read nothing.

timm's drop-path builds its mask as ``x.new_empty((B, 1, 1)).bernoulli_(keep)``: ``new_empty``
takes the chain value's dtype and device, not its values, yet as a reader of the chain value it
would end the chain there and make the mask look computed from it. ``v.new_empty(size)``,
``new_zeros`` and ``new_ones`` become ``torch.empty`` / ``zeros`` / ``ones`` of that size, in the
dtype and device ``v`` was traced with (or those the call names): the same tensor, with no edge to
``v``.
"""

from __future__ import annotations

import torch
from torch.fx import Graph, Node

from ..canonical import example_value

FACTORIES = {"new_empty": torch.empty, "new_zeros": torch.zeros, "new_ones": torch.ones}


def detach_from_values(graph: Graph) -> int:
    """Rewrite every shape-only read of ``graph`` into its factory; how many."""
    found = 0
    for node in list(graph.nodes):
        factory = FACTORIES.get(node.target) if node.op == "call_method" else None
        value = example_value(node.args[0]) if factory is not None and node.args else None
        if not isinstance(value, torch.Tensor):
            continue
        size = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
        if not size or not all(isinstance(d, int) or _is_size(d) for d in size):
            continue  # a size computed at run time (a torch.Size value): left as it is
        kwargs = {"dtype": value.dtype, "device": value.device, **node.kwargs}
        with graph.inserting_before(node):
            made = graph.call_function(factory, (tuple(size),), kwargs)
        made.meta.update(node.meta)
        node.replace_all_uses_with(made)
        graph.erase_node(node)
        found += 1
    return found


def _is_size(d) -> bool:
    return isinstance(d, Node) and isinstance(example_value(d), (int, torch.SymInt))
