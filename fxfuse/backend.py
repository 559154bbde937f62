"""The torch.compile backend: canonicalize → match → build → rewrite → Inductor, and report.

``torch.compile(model, backend="fxfuse", mode=..., options=...)`` reaches ``fxfuse_backend`` through
the ``torch_dynamo_backends`` entry point. fxfuse's own options are taken out of ``options``; the
rest, and ``mode``, go to Inductor unchanged, which compiles everything fxfuse did not fuse. A graph
left with nothing but fused ops (and no mode or option asked of Inductor) runs as it is.
Nothing here may fail the user's compile: a chain that cannot be built stays with Inductor.
"""

from __future__ import annotations

import math
import operator
import os
import warnings
from dataclasses import replace

import torch
from torch._dynamo.exc import RestartAnalysis
from torch.fx import Graph, GraphModule

from . import op as _op  # noqa: F401  (registers torch.ops.fxfuse.*)
from .canonical import example_value
from .canonicalize import canonicalize
from .example_values import values_on_example_inputs
from .graph_timing import compare, worth_timing
from .match import Chain, Decision, match_all
from .policy import POLICIES, inductor_is_faster, size_hint
from .report import record
from .rewrite import FUSED_OP, records_backward, rewrite

FXFUSE_OPTIONS = {
    "allow_cpu": "fuse CPU tensors too (the reference kernel; for tests and CPU-only machines)",
    "policy": "'fastest' (default): leave a chain to Inductor where Inductor measured faster "
              "(fxfuse/policy.py); 'always': fuse every chain",
}


def fxfuse_backend(gm: GraphModule, example_inputs, mode: str | None = None, options=None):
    """Fuse GEMM epilogues in ``gm``, then hand the graph to Inductor."""
    inductor_options = dict(options or {})
    ours = {k: inductor_options.pop(k) for k in list(inductor_options) if k in FXFUSE_OPTIONS}
    allow_cpu = bool(ours.get("allow_cpu", os.environ.get("FXFUSE_ALLOW_CPU") == "1"))
    policy = ours.get("policy", os.environ.get("FXFUSE_POLICY", "fastest"))
    if policy not in POLICIES:
        raise ValueError(f"fxfuse: policy must be one of {POLICIES}, not {policy!r}")
    fused, chains = fuse_chains(gm, allow_cpu, policy, example_inputs)
    compiled = _compiled(fused, example_inputs, mode, inductor_options)
    if (policy == "fastest" and mode in (None, "default") and not inductor_options
            and worth_timing(chains, gm.graph, example_inputs)):
        compiled, chains = _faster_of(compiled, chains, gm, fused, example_inputs)
    record(chains)
    return compiled


def _compiled(gm: GraphModule, example_inputs, mode: str | None, inductor_options: dict):
    """``gm`` as Inductor compiles it, or as it is when it has nothing left for Inductor."""
    if mode in (None, "default") and not inductor_options and _only_fused_ops(gm):
        return gm  # nothing left for Inductor: its wrapper would only add per-call CPU time
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    from .cache_key import keyed_options

    config = keyed_options({**list_mode_options(mode or "default"), **inductor_options})
    return compile_fx(gm, example_inputs, config_patches=config)


def _faster_of(compiled, chains: list[Chain], gm: GraphModule, fused: GraphModule,
               example_inputs) -> tuple[object, list[Chain]]:
    """The fused graph, or Inductor's compile of the graph as Dynamo traced it where that measured
    faster (fxfuse.graph_timing), with the report's rows saying which and by how much."""
    try:
        times, alone = compare(compiled, lambda: _compiled(gm, example_inputs, None, {}), gm, fused, example_inputs)
    except RestartAnalysis:  # Dynamo's request to trace again, not a failure to time
        raise
    except Exception as error:  # noqa: BLE001 - the chains' own measurements stand
        warnings.warn(f"fxfuse: the whole graph could not be timed ({type(error).__name__}: {error})")
        return compiled, chains
    if not times.fused_is_slower:
        return compiled, [replace(c, decision=replace(c.decision, path=f"{c.decision.path}; {times.describe()}"))
                          if c.decision is not None else c for c in chains]
    reason = (f"Inductor's compile of the whole graph is faster ({times.describe()}, on the compile's "
              "inputs); policy='always' fuses it")
    return alone, [c.unfused(reason) if c.fusion is not None else c for c in chains]


def _only_fused_ops(gm: GraphModule) -> bool:
    """The graph computes nothing but fused ops (and picks their outputs) and records no backward:
    at decode sizes a call is CPU-bound, and running it as is costs Dynamo's guards plus the op
    (BENCHMARKS.md, CPU). A graph that will run backward goes to Inductor, which compiles the
    fused ops' backward (plain torch ops) into its kernels."""
    calls = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    return any(n.target is FUSED_OP for n in calls) and all(
        n.target is operator.getitem or (n.target is FUSED_OP and not n.kwargs["save_gemm"]) for n in calls
    )


def fuse_chains(gm: GraphModule, allow_cpu: bool = False, policy: str = "fastest",
                example_inputs=()) -> tuple[GraphModule, list[Chain]]:
    """A copy of ``gm`` with every fusable chain replaced by the fused op, and the chains (the
    report's rows); ``example_inputs``: the graph's inputs on its first call, which the selection
    times on. ``gm`` itself and no chains where fusion failed (with a warning)."""
    graph = Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    try:
        chains = match_all(graph, canonicalize(graph), allow_cpu)
        if policy == "fastest":
            chains = [_unfused_if_slower(chain) for chain in chains]
        chains = _build(chains, policy == "fastest", lambda nodes: values_on_example_inputs(graph, gm, example_inputs, nodes))
        if policy == "fastest":
            chains = [_unfused_if_slower(chain, after_selection=True) for chain in chains]
        rewrite(graph, chains)
        graph.lint()
    except RestartAnalysis:  # Dynamo's request to trace again (a float specialized), not a failure
        raise
    except Exception as error:  # never fail the user's compile
        warnings.warn(f"fxfuse: fusion skipped for this graph ({type(error).__name__}: {error})")
        return gm, []
    return _with_dynamos_metadata(GraphModule(gm, graph), gm), chains


def _with_dynamos_metadata(fused: GraphModule, gm: GraphModule) -> GraphModule:
    """``fused`` carrying what Dynamo attached to ``gm`` for AOTAutograd: the graph's meta (its
    compile id), the parameters' sources and each placeholder's source. Without them AOTAutograd
    takes the graph for one Dynamo did not capture: no parameter or buffer counts as a static
    input, and CUDA graphs skip any graph that updates a buffer (a training BatchNorm's running
    statistics)."""
    old_inputs, new_inputs = gm.graph.find_nodes(op="placeholder"), fused.graph.find_nodes(op="placeholder")
    if len(old_inputs) != len(new_inputs):  # (the rewrite adds no input; were it to, stay unmarked)
        return fused
    fused.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        fused._param_name_to_source = gm._param_name_to_source
    for old, new in zip(old_inputs, new_inputs):
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    return fused


KEEPS_GEMM_OUTPUT = "the forward keeps the GEMM output for the backward, which the in-GEMM epilogue does not store"


def wants_gemm_module(chain: Chain) -> bool:
    """Whether a CUDA chain's compile builds a GEMM module for it: not for a training forward (it
    runs the row path, _with_path) nor for calls that can never take one
    (``engine.never_taken_reason``: GPT-2's Conv1D weight stored (K, N), a program no module is
    generated for), minutes of CUTLASS for no call. TF32's setting is left to prepare_many."""
    from .cuda.engine import never_taken_reason

    return not records_backward(chain.gemm) and never_taken_reason(
        chain.program, chain.dtype, chain.fusion.weight_is_kn) is None


def _build(chains: list[Chain], against_inductor: bool = False, values_of=lambda nodes: {}) -> list[Chain]:
    """Compile the CUDA kernels of a graph's chains now, in parallel (never at call time), then
    measure each chain's paths at its shape (fxfuse.cuda.select; ``against_inductor``: Inductor's
    kernels for the chain too), on its operands' values where ``values_of`` (nodes -> {node:
    value}) computes them; a chain whose build fails is left to Inductor, with the reason in the
    report."""
    chains = [_unfused_if_no_kernel(chain) for chain in chains]
    wanted, gemms = {}, []
    for chain in chains:
        if _on_cuda(chain):
            wanted[(chain.program.to_string(), chain.dtype)] = chain.program
            if wants_gemm_module(chain):
                gemms.append((chain.program, chain.dtype, param_dtypes(chain), rows_of(chain)))
    if not wanted:
        return chains
    try:
        from . import cuda

        failed = cuda.prepare_many([(program, dtype) for (_, dtype), program in wanted.items()], gemm_items=gemms)
    except Exception as error:
        failed = {key: error for key in wanted}
    chains = [_unfused_if_failed(chain, failed) for chain in chains]
    values = values_of(_operand_nodes(chains))
    return [_with_path(chain, against_inductor, _operands(chain, values)) for chain in chains]


def _operand_nodes(chains: list[Chain]) -> set:
    """The operand nodes of the chains the selection will time, the first chain of each program
    and shape (the others take its measurement)."""
    nodes, seen = set(), set()
    for chain in chains:
        if not _on_cuda(chain) or records_backward(chain.gemm):
            continue
        f = chain.fusion
        key = (f.program.to_string(), chain.dtype, *(tuple(map(size_hint, example_value(n).shape)) for n in (f.x, f.weight)))
        if key not in seen and all(isinstance(p, torch.fx.Node) for p in f.params):
            seen.add(key)
            nodes.update(n for n in (f.x, f.weight, f.bias, *f.params) if n is not None)
    return nodes


def _operands(chain: Chain, values: dict) -> tuple | None:
    """(x, weight, bias, params) of ``chain`` as the model computed them, in the dtypes the op
    reads them (autocast casts the GEMM's operands and second GEMMs' weights), or None."""
    f = chain.fusion
    if f is None or any(n is not None and n not in values for n in (f.x, f.weight, f.bias, *f.params)):
        return None
    x, weight, bias = (None if n is None else values[n].detach().to(chain.dtype) for n in (f.x, f.weight, f.bias))
    gemms = set(f.program.second_gemms)
    params = [values[p].detach().to(chain.dtype) if i in gemms else values[p].detach() for i, p in enumerate(f.params)]
    return x, weight, bias, params


def param_dtypes(chain: Chain) -> tuple[torch.dtype, ...]:
    """The dtypes the chain's parameters reach the op in (a GEMM module is built per tuple)."""
    values = [example_value(p) for p in chain.fusion.params]
    return tuple(v.dtype if isinstance(v, torch.Tensor) else torch.float32 for v in values)


def _with_path(chain: Chain, against_inductor: bool = False, operands: tuple | None = None) -> Chain:
    """``chain`` with the GPU path its shape was measured to run fastest on (the report's path),
    timed on ``operands`` (``_operands``) where given."""
    if not _on_cuda(chain):
        return chain
    if records_backward(chain.gemm):
        return replace(chain, decision=Decision(f"cuBLAS + row pass ({KEEPS_GEMM_OUTPUT})"))
    from . import cuda

    f = chain.fusion
    x, weight = example_value(f.x), example_value(f.weight)
    try:
        k, n = size_hint(x.shape[-1]), size_hint(weight.shape[1] if f.weight_is_kn else weight.shape[0])
        m = rows_of(chain)
        shapes = tuple(tuple(size_hint(s) for s in example_value(p).shape) for p in f.params)
        selection = cuda.select(f.program, chain.dtype, param_dtypes(chain), (m, n, k),
                                f.bias is not None, shapes, against_inductor, f.weight_is_kn, operands)
    except Exception as error:  # noqa: BLE001 - the row path serves; say why
        return replace(chain, decision=Decision(f"cuBLAS + row pass (selection failed: {type(error).__name__}: {error})"))
    if selection is None:  # no GEMM module, and nothing else timed: say why there is none
        why = cuda.engine.gemm_error(f.program, chain.dtype, param_dtypes(chain), x.device, f.weight_is_kn)
        return replace(chain, decision=Decision("cuBLAS + row pass" + (f" ({why.splitlines()[0]})" if why else "")))
    return replace(chain, decision=Decision(selection.describe(), selection))


def rows_of(chain: Chain) -> int:
    """The rows of the chain's GEMM at the example's shape (the product of x's leading sizes)."""
    return math.prod(size_hint(s) for s in example_value(chain.fusion.x).shape[:-1])


def _on_cuda(chain: Chain) -> bool:
    """A fused chain whose GEMM reads a CUDA tensor: the GPU back end runs it."""
    x = None if chain.fusion is None else example_value(chain.fusion.x)
    return isinstance(x, torch.Tensor) and x.device.type == "cuda"


def _unfused_if_slower(chain: Chain, after_selection: bool = False) -> Chain:
    """``chain`` left to Inductor where Inductor is faster: as the selection measured it at the
    chain's shape where it timed Inductor's kernels, else as the policy's rules say;
    ``after_selection``: asked again once the chain's GPU path is measured."""
    if chain.program is None:
        return chain
    gemm_out = example_value(chain.gemm)
    if not isinstance(gemm_out, torch.Tensor):
        return chain
    # a chain stopped at a wider op: Inductor fuses that op too, which the measurement does not see
    stopped_at = chain.reason if chain.stops_at_wider_dtype else None
    selection = chain.decision.selection if chain.decision else None
    measured = selection.inductor_is_faster() if after_selection and selection and not stopped_at else None
    if measured is False:
        return chain
    if measured:
        reason = (f"{selection.why_inductor()} (measured when the graph compiled; "
                  f"fxfuse's fastest: {chain.path}); policy='always' fuses it")
    else:
        reason = inductor_is_faster(chain.program, gemm_out, stopped_at, after_selection)
        if reason is None:
            return chain
        if after_selection and chain.path:
            reason = f"{reason}; measured path: {chain.path}"
    return chain.unfused(reason)


def _unfused_if_no_kernel(chain: Chain) -> Chain:
    """A CUDA chain the row kernels cannot express goes to Inductor (the reference would run it
    on the GPU, slower); on the CPU the reference is the kernel."""
    if not _on_cuda(chain):
        return chain
    from .cuda.codegen import unsupported_reason

    reason = unsupported_reason(chain.program)
    if reason is None:
        return chain
    if chain.without_keep is not None:  # the chain up to its second output, which it then returns
        shorter = _unfused_if_no_kernel(chain.without_keep)
        return replace(shorter, reason=f"{shorter.reason}; the CUDA kernels return no second value yet")
    return chain.unfused(f"no CUDA kernel: {reason}")


def _unfused_if_failed(chain: Chain, failed: dict) -> Chain:
    error = failed.get((chain.program.to_string(), chain.dtype)) if chain.program else None
    if error is None:
        return chain
    first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
    warnings.warn(f"fxfuse: chain left to Inductor, its CUDA build failed: {first_line}")
    return chain.unfused(f"CUDA build failed: {first_line}")
