"""Numbers Dynamo left symbolic, made the numbers they were traced with where a spelled op reads them.

Under ``torch.compile(..., dynamic=True)`` a module's float attributes (a divisor, a LeakyReLU
slope, a clamp bound) reach the graph as inputs read with ``.item()``: symbolic floats. An
epilogue compiles its constants into its kernel, so where an op fxfuse has a spelling for reads
such a float, it reads the value instead. Reading it guards the graph on that value: a new value
compiles again, as it would without ``dynamic=True``. Without ``dynamic=True`` Dynamo makes a
float symbolic only once it has seen it change (a float passed to each call, an annealed dropout
rate): that one stays symbolic, and its op ends the chain, lest every new value compile again.
Symbolic integers are left as they are: they are sizes, and a batch size must stay symbolic; so
are floats computed from sizes (``1 / batch``). A float the graph computes from constants alone
(``math.sqrt(2 / math.pi)`` once pi was specialized) is its value everywhere, with no guard.
"""

from __future__ import annotations

import torch
from torch.fx import Graph
from torch.utils._sympy.symbol import SymT, symbol_is_type

from ..canonical import example_value
from . import has_spelling


def specialize_floats(graph: Graph) -> int:
    """Replace every float a spelled op reads that the graph computes from constants, and under
    ``dynamic=True`` every traced symbolic float of the graph's float inputs, by its value in those
    readers (the graph guards on the latter); how many floats."""
    guards_allowed = not torch._dynamo.config.assume_static_by_default  # else symbolic: seen to change
    found = 0
    for node in list(graph.nodes):
        number = _number(example_value(node), guards_allowed) if node.op in ("call_function", "call_method") else None
        readers = [user for user in node.users if has_spelling(user)] if number is not None else []
        for user in readers:
            user.replace_input_with(node, number)
        found += bool(readers)
    return found


def _number(value, guards_allowed: bool) -> float | None:
    """The float ``value`` is, where it is a constant (a SymFloat of no symbol: ``math.sqrt(2 /
    math.pi)`` once pi was specialized) or, with ``guards_allowed``, a function of float inputs
    alone with a traced value (reading it guards); None otherwise (a size's, or an unbacked one)."""
    if isinstance(value, float):
        return value
    if not isinstance(value, torch.SymFloat):
        return None
    symbols = value.node.expr.free_symbols
    if not symbols:
        return float(value)
    if guards_allowed and value.node.hint is not None and all(symbol_is_type(s, SymT.FLOAT) for s in symbols):
        return float(value)  # the guard
    return None
