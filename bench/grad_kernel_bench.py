"""The backward of a fused chain: fxfuse's generated kernel against Inductor's fusion of the same
derivative, per suite row at full size.

    python bench/grad_kernel_bench.py [--rows S01,S10] [--dtype bf16|autocast] [--policy always] [--once]

For every row: the model (training mode; an eval row in eval mode) compiled by Inductor, by fxfuse with the backward as
plain torch ops (``FXFUSE_GENERATED_BACKWARD=0``: Inductor compiles the reference's derivative),
and by fxfuse with the generated kernel (``=1``: it writes dY and the bias and parameter column
sums in one pass); one forward, then the backward alone — ``torch.autograd.grad`` with
``retain_graph`` — timed as the kernels' GPU time per backward (torch.profiler), split into cuBLAS
GEMMs (dX, dW: the same for every variant) and the rest, and as the wall time of 20 back-to-back
backwards (CUDA events). Byte floor of the rest: read the saved GEMM output and the output
gradient (one value a row after a reduction), write dY, once each. ``--once`` calls each row's
generated kernel once on fresh tensors and prints nothing else: the mode to run under ncu
(``--kernel-name regex:grad_kernel``).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch._functorch.config
import torch._inductor.config
from tabulate import tabulate

import fxfuse.cuda as fxcuda
from bench.epilogue_breakdown import DTYPES, event_us, traced_calls
from bench.train_bench import Compile, variant
from bench.train_profile import is_gemm
from examples import suite
from fxfuse.cuda import codegen
from fxfuse.op import GENERATED_BACKWARD_ENV

POINTWISE_ROWS = "S01,S09,S10,S12,S13,S14,S19"
VARIANTS = {"inductor": None, "fxfuse+ops": "0", "fxfuse+generated": "1"}  # FXFUSE_GENERATED_BACKWARD


def backward_kernels(backward, calls: int = 5) -> tuple[float, float, dict[str, float]]:
    """(GEMM µs, rest µs, {kernel: µs}) of one call of ``backward``, by torch.profiler."""
    backward()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            backward()
        torch.cuda.synchronize()
    per_name: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time > 0:
            per_name[event.name] += event.device_time / calls
    gemm = sum(us for name, us in per_name.items() if is_gemm(name))
    return gemm, sum(per_name.values()) - gemm, per_name


def compiled_backward(row, name: str, autocast: bool, policy: str = "fastest"):
    """The backward of one forward of ``row``'s model compiled as ``name``, as a callable."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    dtype = torch.float32 if autocast else torch.bfloat16
    model, inputs = suite.build(row, "full", "cuda", dtype)
    if VARIANTS[name] is None:
        os.environ.pop(GENERATED_BACKWARD_ENV, None)
    else:
        os.environ[GENERATED_BACKWARD_ENV] = VARIANTS[name]
    # an eval row (S22) in eval mode: its BatchNorm frozen, as when a model is fine-tuned
    model.train(not row.eval_mode)
    module, compiled = variant(model, "inductor" if name == "inductor" else "fxfuse", Compile(policy=policy))
    leaves = [t.requires_grad_() for t in inputs if t.is_floating_point()] + list(module.parameters())
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = compiled(*inputs)
    grad = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True)


def floor_bytes(program, m: int, n: int, autocast: bool) -> int:
    """Bytes the generated pass must move: read y (bf16), read the output's gradient (float32
    under autocast, where the suite's reductions and softmax widen; one value a row after a
    reduction), write dY (bf16)."""
    grad_elements = m if program.reduction else m * n
    return 2 * 2 * m * n + grad_elements * (4 if autocast else 2)


def run_once(rows, dtype: torch.dtype) -> None:
    """Each row's generated kernel once, on fresh tensors of the traced shapes (for ncu)."""
    for row in rows:
        for program, x, w, _, params in traced_calls(row, dtype):
            if codegen.has_generated_backward(program):
                fxcuda.prepare(program, dtype)
                m, n = x.numel() // x.shape[-1], w.shape[0]
                y = torch.randn(m, n, device="cuda", dtype=dtype)
                grad = torch.randn(program.output_shape((m,), n), device="cuda", dtype=dtype)
                print(f"call: {row.id} {program.to_string()}", flush=True)
                torch.ops.fxfuse.epilogue_backward(program.to_string(), grad, y, params)
    torch.cuda.synchronize()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default=POINTWISE_ROWS)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "autocast"))
    parser.add_argument("--once", action="store_true")
    parser.add_argument("--policy", default="fastest", choices=("fastest", "always"))
    parser.add_argument("--bandwidth-gbs", type=float, default=4300.0, help="copy bandwidth for the floor")
    args = parser.parse_args()
    rows = suite.select(args.rows.split(","))
    if args.once:
        run_once(rows, DTYPES["bf16"])
        return 0
    # every variant compiled afresh (torch's caches key on the flag, fxfuse/cache_key.py)
    torch._functorch.config.enable_autograd_cache = False
    torch._inductor.config.fx_graph_cache = False
    table, details = [], []
    for row in rows:
        shapes = [(program, x.numel() // x.shape[-1], w.shape[0]) for program, x, w, *_
                  in traced_calls(row, torch.bfloat16) if codegen.has_generated_backward(program)]
        floor_us = sum(floor_bytes(program, m, n, args.dtype == "autocast")
                       for program, m, n in shapes) / (args.bandwidth_gbs * 1e3)
        rest = {}
        for name in VARIANTS:
            backward = compiled_backward(row, name, args.dtype == "autocast", args.policy)
            gemm, rest[name], kernels = backward_kernels(backward)
            wall = event_us(backward, calls=20)
            table.append([row.id, name, f"{gemm:.1f}", f"{rest[name]:.1f}", f"{wall:.1f}"])
            details += [[row.id, name, f"{us:.1f}", kernel[:90]] for kernel, us in kernels.items() if not is_gemm(kernel)]
        table[-1] += [f"{rest['inductor'] / rest['fxfuse+generated']:.2f}", f"{floor_us:.1f} ({len(shapes)} programs)"]
    os.environ.pop(GENERATED_BACKWARD_ENV, None)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  dtype {args.dtype}  (µs per backward)")
    print(tabulate(table, headers=["row", "variant", "GEMM", "rest", "wall", "inductor/generated (rest)",
                                   "floor of the generated pass"]))
    print()
    print(tabulate(details, headers=["row", "variant", "µs", "kernel (not GEMM)"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
