"""Step 5b: the compiled graph timed with its chains fused and as Inductor alone compiles it.

A chain timed alone is not the chain in the model. There Inductor may fuse it with its neighbours,
and one cuBLAS GEMM's time varies by 30 % with the work around it (BENCHMARKS.md section 15: S26's
SwiGLU chain won its selection by 12-15 % and the model ran 1.06x Inductor's in pipelined calls).
So where a graph's chains won a selection that timed Inductor's kernels (the measured decisions),
the backend compiles the graph both ways and times both on the compile's example inputs, as the
benchmark measures a model: GPU time (CUDA-graph replays) and back-to-back launches. The fused
graph runs only where it is slower by neither; otherwise Inductor's, and the report says why.
Each graph runs alone for a while before it is sampled (``blocked_medians``): sampled round-robin,
Inductor's S26 ran in the state fxfuse's CUTLASS kernels left on the card, and the check kept a
graph that, run alone, was 11 % slower (BENCHMARKS.md section 17).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch.fx import Graph, GraphModule

from .example_values import is_fake, mutates
from .match import Chain


# Two candidates only: each settles longer into the state it leaves the card in (a model at the
# power limit takes a few hundred ms; BENCHMARKS.md section 17)
WHOLE_GRAPH_SETTLE_S = 0.3


@dataclass(frozen=True)
class GraphTimes:
    """Median microseconds per call of the two compiled graphs."""

    fused_gpu: float  # CUDA-graph replays: GPU time
    inductor_gpu: float
    fused_launched: float  # back-to-back launches between CUDA events
    inductor_launched: float

    @property
    def fused_is_slower(self) -> bool:
        return self.fused_gpu > self.inductor_gpu or self.fused_launched > self.inductor_launched

    def describe(self) -> str:
        return (f"whole graph: fxfuse {self.fused_gpu:.1f} us GPU time, {self.fused_launched:.1f} us per "
                f"launched call; Inductor alone {self.inductor_gpu:.1f} / {self.inductor_launched:.1f} us")


def worth_timing(chains: Sequence[Chain], graph: Graph, example_inputs: Sequence) -> bool:
    """The graph's fused chains include a measured decision against Inductor, and timing the
    graph twice is harmless: it runs on CUDA tensors the compile was handed (not fakes), mutates
    nothing and draws no random numbers (a random op, a dropout in training: a fused chain's
    dropout is still its F.dropout node in the traced graph)."""
    measured = [c for c in chains if c.decision is not None and c.decision.selection is not None
                and c.decision.selection.inductor_is_faster() is False]
    if not measured:
        return False
    inputs = list(example_inputs)
    if any(is_fake(v) for v in inputs) or not any(isinstance(v, torch.Tensor) and v.is_cuda for v in inputs):
        return False
    return not any(mutates(node) or _draws_random_numbers(node) for node in graph.nodes)


def compare(fused: Callable, compile_alone: Callable[[], Callable], traced: GraphModule, rewritten: GraphModule,
            example_inputs: Sequence) -> tuple[GraphTimes, Callable | None]:
    """The two graphs' times, measured once per graph pair, inputs, card, torch and fxfuse (kept
    beside the chains' selections, so a warm compile does not compile Inductor's graph again only
    to time it), and Inductor's compiled graph (``compile_alone()``) where it was compiled: to
    time it, or because it is the faster."""
    from .cuda.engine import read_measurement, write_measurement

    disk = _timing_file(traced, rewritten, example_inputs)
    times, alone = read_measurement(disk, GraphTimes), None
    if times is None:
        alone = compile_alone()
        times = time_both(fused, alone, example_inputs)
        write_measurement(disk, times)
    if times.fused_is_slower and alone is None:
        alone = compile_alone()
    return times, alone


def _timing_file(traced: GraphModule, rewritten: GraphModule, example_inputs: Sequence) -> Path:
    from .cache_key import fxfuse_uuid
    from .cuda.build import cache_root

    device = next(v.device for v in example_inputs if isinstance(v, torch.Tensor) and v.is_cuda)
    inputs = "; ".join(f"{tuple(v.shape)} {v.stride()} {v.dtype}" if isinstance(v, torch.Tensor) else repr(v)
                       for v in example_inputs)
    text = "\n".join([traced.code, rewritten.code, inputs, torch.cuda.get_device_name(device), torch.__version__,
                      fxfuse_uuid()])
    return cache_root() / "selections" / f"graph-{hashlib.sha256(text.encode()).hexdigest()[:32]}.json"


def time_both(fused: Callable, inductor: Callable, example_inputs: Sequence) -> GraphTimes:
    """Both compiled graphs timed on ``example_inputs``, each alone for a while in turn
    (``blocked_medians``), with the random number generators' state restored afterwards."""
    from .cuda.timing import blocked_medians, time_candidates, time_us

    calls = {"fused": _caller(fused, example_inputs), "inductor": _caller(inductor, example_inputs)}
    device = next(v.device for v in example_inputs if isinstance(v, torch.Tensor) and v.is_cuda)
    with torch.no_grad(), torch.random.fork_rng(devices=[device]):
        # A B B A A B B A: two identical graphs timed so read within 2 % (BENCHMARKS.md section 17)
        gpu, _ = time_candidates(calls, settle_s=WHOLE_GRAPH_SETTLE_S, passes=4)
        launched = blocked_medians(calls, time_us, passes=4, settle_s=WHOLE_GRAPH_SETTLE_S)
    return GraphTimes(gpu["fused"], gpu["inductor"], launched["fused"], launched["inductor"])


def _caller(compiled: Callable, example_inputs: Sequence) -> Callable[[], object]:
    """``compiled`` called as Dynamo calls a backend's result."""
    return lambda: compiled(*example_inputs)


def _draws_random_numbers(node) -> bool:
    """A random op, or a dropout in training mode (in eval mode it is the identity)."""
    name = getattr(node.target, "__name__", str(node.target))
    if node.op not in ("call_function", "call_method"):
        return False
    if "dropout" in name:
        training = node.args[2] if len(node.args) > 2 else node.kwargs.get("training", True)
        return training is not False
    return name.startswith(("rand", "normal", "bernoulli", "multinomial", "poisson", "uniform", "exponential"))
