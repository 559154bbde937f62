"""Which fused chains fxfuse hands back to Inductor because Inductor runs them faster.

"Never slower than Inductor": where the measured kernels lose, the chain is not fused and the
report says why. The rule is the benchmark's finding (BENCHMARKS.md, H200, torch 2.11): on CUDA,
chains with a norm stage (group, layer, RMS or batch norm) over at least 2^20 elements ran
1.03-1.21x Inductor's GPU time in bfloat16 (S17 the exception, 0.96x) and 1.00-1.09x in float32 /
TF32 — those epilogue kernels are instruction-bound at 3-7x their byte floor — while pointwise and
row-reduction chains (S01, S11, S16), and norm chains at decode sizes (M = 16), ran at or near
Inductor's time. A pointwise chain that widens to a float32 output (S09 under bf16 autocast: a
float32 vector promotes) ran 1.03-1.04x Inductor's time with two 16-byte stores a chunk and 1.01x
with one (the same chain in bf16: 1.00x): no gain to take, so it goes to Inductor at that size
too; a widened chain ending in a row reduction or softmax stays (S11: 0.97x).

In a graph that records a backward, a group norm program whose groups a warp's lanes hold (the
row-local kernels, S02, S04, S08, S17) stays fused at any size: its forward and the generated
backward together measured 1.05-1.16x faster than Inductor's forward and backward of the chain
under bf16 autocast (H100; S02 and S08 1.05-1.08x on the H200), where larger groups (S06, 0.94x),
layer norms (S20, 0.98-1.03x) and RMS norms (S21, 0.98x) did not gain (BENCHMARKS.md section 6).

Outside training no rule decides: every chain on CUDA is kept for the selection, which times
fxfuse's paths (the row pass, and the in-GEMM kernel's configurations where the in-GEMM path takes
the chain: Hopper, CUTLASS headers, bf16/fp16 or float32 with TF32 allowed) and Inductor's own kernels for the chain at the
chain's shape, on this card, and leaves the chain to Inductor where Inductor is faster
(fxfuse/cuda/engine.py). The rules below decide where no such measurement happens — in a graph
that records a backward (the selection times forward calls) and where the timing failed — and
they show why the measurement matters: a separate pass over M x N costs a share of the GEMM that grows
as 1/K — S08's in-tile group norm (K = 1024) measured 0.86x Inductor's GPU time, S02 and S04 (K =
8192) 1.00-1.03x (BENCHMARKS.md section 10) — and S26's GEMMs reading the gate and the residual
in their epilogues measured 0.90-0.92x Inductor's kernels for those chains (section 13), while
S15's row reduction, which the rules kept fused, measured 1.04x Inductor's GPU time through the
row pass (section 19). A chain must win by a margin (engine.INDUCTOR_MARGIN): S25's chain won by
0.4 % alone and lost 6 % in the model, where Inductor fuses around it.

A pointwise chain reading an operand of the output's shape (a residual, a gate) reads it once
more than the chain's output; Inductor's pointwise kernel reads it too, and S26 (Llama's MLP: the
SwiGLU product and the residual add, bf16, H100) measured 1.04x Inductor's GPU time through the
row pass: where no measurement decides, such chains go to Inductor at large sizes.

A rotary embedding (Llama's q and k: 8192 x 4096, heads of 128, bf16, H100) measured 1.05x
Inductor's kernels per chain through the row pass (BENCHMARKS.md section 21): where no measurement
decides, such chains go to Inductor at large sizes.

A pooling along the features runs in the row kernels (through shared memory) but has not been
timed against Inductor by a benchmark: where no measurement decides, such chains go to Inductor at
large sizes too.

A chain cut short by an op that computes in a dtype it cannot take (float64; autocast's float32
ops and float32 promotions widen the chain instead) also goes to Inductor: Inductor fuses that op
and what follows with the chain's ops into kernels that read the GEMM output, while a fused prefix
makes them read its output instead — one more write and read of M x N (S08 under bf16 autocast,
when its chain stopped at the float32 add: forward + backward 2.51 ms of kernels with the prefix
fused against 2.30 ms as Inductor's).
``options={"policy": "always"}`` (or FXFUSE_POLICY=always) fuses every chain regardless.
"""

from __future__ import annotations

import math

import torch

from .ir import Norm, Program, Reduce, Rotary, row_split
from .patterns.norms import FAMILY as NORMS

POLICIES = ("fastest", "always")
LARGE_ELEMENTS = 1 << 20  # M x N from which the chains below measured slower than Inductor


def size_hint(size) -> int:
    """An int for a (possibly symbolic) size: its value, or the hint Dynamo traced it with. A
    symbol's hint is read, not asked for with ``int()``, which would guard the graph on the traced
    size and take a dynamic graph back to one size."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    hint = size.node.hint
    return int(hint) if hint is not None else LARGE_ELEMENTS  # unbacked: assume a large batch


def inductor_is_faster(program: Program, gemm_out: torch.Tensor, stopped_at: str | None = None,
                       after_selection: bool = False) -> str | None:
    """The reason to leave this chain to Inductor, or None to fuse it (policy "fastest");
    ``gemm_out`` is the GEMM's output value (its example value); ``stopped_at`` is the matcher's
    reason when the chain stops at an op computing in a wider dtype. Before the selection a chain
    outside training is kept for it to measure against Inductor; ``after_selection``: asked again
    because that measurement did not happen (a failed build, Inductor's kernels not timed): the
    rules decide."""
    if gemm_out.device.type != "cuda":
        return None
    if stopped_at is not None:
        return (f"Inductor is faster: {stopped_at}, and Inductor fuses that op with the chain into "
                "kernels reading the GEMM output (a fused prefix costs one more pass over it; "
                "BENCHMARKS.md); policy='always' fuses the prefix")
    if not after_selection and not gemm_out.requires_grad:
        return None  # the selection times it against Inductor's kernels
    slower, untimed = _measured_slower(program), _untimed(program)
    if (slower is None and untimed is None) or (gemm_out.requires_grad and _trains_faster(program, gemm_out)):
        return None
    elements = math.prod(size_hint(s) for s in gemm_out.shape)
    if elements < LARGE_ELEMENTS:
        return None
    if slower is None:
        return (f"left to Inductor: {untimed} over {elements} elements have not been timed against Inductor on a "
                "GPU yet; policy='always' fuses them")
    kind, measured = slower
    return f"Inductor is faster: {kind} over {elements} elements ({measured}); policy='always' fuses them"


def _trains_faster(program: Program, gemm_out: torch.Tensor) -> bool:
    """A group norm program with row-local kernels and the generated backward (module docstring)."""
    from .cuda.codegen import ELEMENT_TYPES, chunk_elements, group_in_lanes
    from .op import uses_generated_backward

    split = row_split(program)
    if split is None or split.norm is None or NORMS[split.norm.kind].statistics != "row group":
        return False
    if gemm_out.dtype not in ELEMENT_TYPES or not uses_generated_backward(program, "cuda"):
        return False
    n = size_hint(gemm_out.shape[-1])
    return group_in_lanes(n, split.norm.groups, chunk_elements(program, gemm_out.dtype))


def _measured_slower(program: Program) -> tuple[str, str] | None:
    """(kind, what the benchmark found) where ``program`` is of a kind of chain that measured
    slower than Inductor at large sizes (BENCHMARKS.md)."""
    if any(isinstance(s, Norm) for s in program.stages):
        return "norm epilogues", "1.0-1.2x Inductor's time on CUDA"
    if any(isinstance(s, Rotary) for s in program.stages):
        return "rotary embeddings", "1.05x Inductor's kernels per chain on CUDA, Llama's q and k"
    if "full" in program.operand_kinds:
        return ("pointwise epilogues reading an operand of the output's shape",
                "1.04x Inductor's GPU time on CUDA, S26")
    if program.ends_widened and not any(isinstance(s, Reduce) for s in program.stages):
        return "pointwise epilogues that widen to float32", "1.01-1.04x Inductor's time on CUDA, S09 under bf16 autocast"
    return None


def _untimed(program: Program) -> str | None:
    """The kind of chain ``program`` is where no benchmark has timed that kind against Inductor
    on a GPU yet: until one does, "never slower than Inductor" leaves it to Inductor at large sizes."""
    return "poolings along the features" if program.pools else None
