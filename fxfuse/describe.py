"""User-level names of FX nodes, for the coverage report: ``mul(2.0)``, ``group_norm(512)``."""

from __future__ import annotations

from torch.fx import Node

LABEL = "fxfuse_label"  # node.meta key: the user's name of the op a rewritten node stands for


def describe(node: Node) -> str:
    """The function or method a node calls, with its number arguments (the user's spelling)."""
    if node.op == "placeholder":
        return _short_placeholder(node)
    if node.op == "output":
        return "output"
    if LABEL in node.meta:  # a node canonicalization wrote in place of the user's
        return node.meta[LABEL]
    target = node.target
    name = target if isinstance(target, str) else getattr(target, "__name__", str(target))
    if name == "getitem":
        index = node.args[1]
        return f"[{', '.join(map(_index_entry, index if isinstance(index, tuple) else (index,)))}]"
    numbers = [a for a in (*node.args, *node.kwargs.values()) if _is_number(a)]
    return f"{name}({', '.join(repr(a) for a in numbers)})" if numbers else name


def _index_entry(entry) -> str:
    """An index as Python writes it: ``:``, ``1:3``, ``...``, ``0``."""
    if entry is Ellipsis:
        return "..."
    if isinstance(entry, slice):
        text = ":".join("" if v is None else str(v) for v in (entry.start, entry.stop))
        return text + (f":{entry.step}" if entry.step is not None else "")
    return str(entry)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _short_placeholder(node: Node) -> str:
    """``L_self_modules_bn_buffers_running_mean_`` -> ``bn.running_mean``."""
    name = str(node.target).removeprefix("L_").removeprefix("self_").strip("_")
    for marker in ("_modules_", "_parameters_", "_buffers_"):
        name = name.replace(marker, ".")
    return name.removeprefix("modules.").removeprefix("parameters.").removeprefix("buffers.")
