"""The values a graph computes for some of its nodes on the compile's example inputs.

The selection times a chain's candidates on the GEMM's operands as the model computes them where
it can, the closest it gets to the model: on an H200, S26's gated chain as Inductor runs it (two
cuBLAS GEMMs and a pointwise kernel) took 2624 µs at selection on Gaussian random operands and
2034 µs inside the model, a gap the model's operands narrowed (2534 µs) but did not close
(BENCHMARKS.md section 15). Dynamo hands the backend the
first call's tensors; the asked nodes' values are computed from them by running only what they
depend on, without autograd and with the random number generators' state put back. A graph
that mutates a tensor (an in-place op, a training BatchNorm's running statistics) is not run at
all: that could change the model's state, and a value could depend on the mutations' order. A
value unlike the node's traced shape, dtype or device (autocast, which the part run here does
not enter) is dropped. Where there is no value the selection draws random data.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_arg

from .canonical import example_value

_INPLACE_FUNCTIONS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ipow,
                      operator.setitem}
# in training these update the running statistics they are given, in place
_NORMS_WITH_RUNNING_STATISTICS = {torch.nn.functional.batch_norm: 5, torch.nn.functional.instance_norm: 5,
                                  torch.batch_norm: 5}  # the position of ``training`` / ``use_input_stats``


def values_on_example_inputs(graph: Graph, module: GraphModule, example_inputs, nodes: set[Node]) -> dict[Node, torch.Tensor]:
    """``{node: value}`` for the nodes of ``nodes`` that could be computed (see the module's
    docstring); nodes of ``graph`` (a copy of ``module``'s graph: same placeholders in the same
    order, ``get_attr`` targets on ``module``)."""
    placeholders = graph.find_nodes(op="placeholder")
    inputs = list(example_inputs)
    if len(placeholders) != len(inputs) or any(is_fake(v) for v in inputs):
        return {}
    if any(mutates(node) for node in graph.nodes):  # its own part, or one whose effect it would read
        return {}
    needed = _ancestors(nodes)
    env: dict[Node, object] = dict(zip(placeholders, inputs))
    devices = sorted({v.device.index or 0 for v in inputs if isinstance(v, torch.Tensor) and v.is_cuda})
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            for node in graph.nodes:
                if node in needed and node not in env:
                    env[node] = _run(node, env, module)
    except Exception:  # noqa: BLE001 - anything this cannot run: random data instead
        return {}
    return {node: env[node] for node in nodes if node in env and _matches(env[node], example_value(node))}


def _ancestors(nodes: set[Node]) -> set[Node]:
    seen, stack = set(), list(nodes)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


def mutates(node: Node) -> bool:
    """An op that writes into one of its arguments (in-place methods and functions, ``inplace=``)."""
    if node.kwargs.get("inplace") is True or node.target in _INPLACE_FUNCTIONS:
        return True
    if node.target in _NORMS_WITH_RUNNING_STATISTICS:
        position = _NORMS_WITH_RUNNING_STATISTICS[node.target]
        training = node.args[position] if len(node.args) > position else node.kwargs.get(
            "training", node.kwargs.get("use_input_stats", False))
        return training is not False
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    schema = getattr(node.target, "_schema", None)
    if schema is not None and schema.is_mutable:
        return True
    return node.op in ("call_method", "call_function") and name.endswith("_") and not name.endswith("__")


def _run(node: Node, env: dict, module: GraphModule):
    args = map_arg(node.args, env.__getitem__)
    kwargs = map_arg(node.kwargs, env.__getitem__)
    if node.op == "get_attr":
        value = module
        for part in node.target.split("."):
            value = getattr(value, part)
        return value
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    if node.op == "call_module":
        return module.get_submodule(node.target)(*args, **kwargs)
    raise RuntimeError(f"cannot run a {node.op} node")


def is_fake(value) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(value, FakeTensor) or (isinstance(value, torch.Tensor) and value.is_meta)


def _matches(value, traced) -> bool:
    from .policy import size_hint  # traced sizes may be symbols: compare their hints

    return (isinstance(value, torch.Tensor) and isinstance(traced, torch.Tensor)
            and tuple(value.shape) == tuple(size_hint(s) for s in traced.shape)
            and value.dtype == traced.dtype and value.device == traced.device)
