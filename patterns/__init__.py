"""The accepted spellings, as data: which FX targets and methods mean which canonical op.

Each module here holds a ``SPELLINGS`` tuple of ``Spelling`` rows. A row's ``build`` function has the
signature of the torch callable it stands for, so a node's args and kwargs bind to it exactly as
they would to torch; it returns a canonical op (fxfuse.canonical) or ``Rejected(reason)``.
Adding an activation is one entry of the function family (patterns/functions.py) plus its device
function.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch.fx import Node

from ..canonical import CanonicalOp, PointwiseOp, Rejected, example_value


@dataclass(frozen=True)
class Spelling:
    build: Callable[..., CanonicalOp]
    targets: tuple  # callables (call_function targets) and str (method names)
    inplace: tuple = ()  # targets that mutate their first argument


def spell(build: Callable[..., CanonicalOp], *targets, inplace: tuple = ()) -> Spelling:
    unique = lambda items: tuple(dict.fromkeys(items))  # F.linear is torch._C._nn.linear, ...
    return Spelling(build, unique(targets), unique(inplace))


def _table() -> dict[tuple[str, object], tuple[Spelling, bool]]:
    from . import activations, feature_pooling, functions, gemm, norms, pointwise, reductions, rotary

    table: dict[tuple[str, object], tuple[Spelling, bool]] = {}
    for module in (gemm, pointwise, functions, norms, reductions, feature_pooling, rotary, activations):
        for row in module.SPELLINGS:
            for target, inplace in [(t, False) for t in row.targets] + [(t, True) for t in row.inplace]:
                kind = "call_method" if isinstance(target, str) else "call_function"
                key = (kind, target)
                if key in table:
                    raise AssertionError(f"{target} is spelled twice")
                table[key] = (row, inplace)
    return table


_TABLE: dict | None = None


def lookup_table() -> dict[tuple[str, object], tuple[Spelling, bool]]:
    """(node kind, target) -> (spelling, in place), built on first use."""
    global _TABLE
    if _TABLE is None:
        _TABLE = _table()
    return _TABLE


def reset_table() -> None:
    """Build the table again on next use (a spelling was registered)."""
    global _TABLE
    _TABLE = None


def _entry(node: Node) -> tuple[Spelling, bool] | None:
    """The (row, in place) of the spelling that covers ``node``'s target, or None."""
    try:
        return lookup_table().get((node.op, node.target))
    except TypeError:  # an unhashable target
        return None


def has_spelling(node: Node) -> bool:
    """Whether some spelling covers ``node``'s target (its arguments unchecked)."""
    return _entry(node) is not None


def lookup(node: Node) -> CanonicalOp | None:
    """The canonical meaning of ``node``, or None when no spelling covers its target."""
    entry = _entry(node)
    if entry is None:
        return None
    row, inplace = entry
    try:
        inspect.signature(row.build).bind(*node.args, **node.kwargs)
    except TypeError as error:
        return Rejected(f"unexpected arguments: {error}")
    try:
        op = row.build(*node.args, **node.kwargs)
    except (TypeError, ValueError) as error:
        computed = [a.name for a in node.all_input_nodes if not isinstance(example_value(a), torch.Tensor)]
        if not computed:
            raise
        return Rejected(f"{', '.join(computed)} computed in the graph where a number is expected ({error})")
    if inplace and isinstance(op, PointwiseOp):
        op = replace(op, inplace=True)
    return op
