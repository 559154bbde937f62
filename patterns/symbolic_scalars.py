"""Numbers Dynamo left symbolic, made the numbers they were traced with where a spelled op reads them.

Under ``torch.compile(..., dynamic=True)`` a module's float attributes (a divisor, a LeakyReLU
slope, a clamp bound) reach the graph as inputs read with ``.item()``: symbolic floats. An
epilogue compiles its constants into its kernel, so where an op fxfuse has a spelling for reads
such a float, it reads the value instead. Reading it guards the graph on that value: a new value
compiles again, as it would without ``dynamic=True``. Symbolic integers are left as they are: they
are sizes, and a batch size must stay symbolic; so are floats computed from sizes (``1 / batch``).
"""

from __future__ import annotations

import torch
from torch.fx import Graph
from torch.utils._sympy.symbol import SymT, symbol_is_type

from ..canonical import example_value
from . import has_spelling


def specialize_floats(graph: Graph) -> int:
    """Replace every traced symbolic float that a spelled op reads by its value in those readers
    (the graph now guards on it); how many floats."""
    found = 0
    for node in list(graph.nodes):
        value = example_value(node)
        if not isinstance(value, torch.SymFloat) or value.node.hint is None or not _of_float_inputs(value):
            continue  # (no value to specialize on, or a size's: its readers stay unfused)
        readers = [user for user in node.users if has_spelling(user)]
        if not readers:
            continue
        number = float(value)  # the guard
        for user in readers:
            user.replace_input_with(node, number)
        found += 1
    return found


def _of_float_inputs(value: torch.SymFloat) -> bool:
    """Whether ``value`` is computed from the graph's float inputs alone (no size in it)."""
    symbols = value.node.expr.free_symbols
    return bool(symbols) and all(symbol_is_type(symbol, SymT.FLOAT) for symbol in symbols)
