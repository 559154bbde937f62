"""Whole-graph timing of a suite row inside and outside the compile.

The backend's whole-graph check (fxfuse/graph_timing.py) times the graph compiled with its chains
fused against Inductor's compile of the same graph, during the compile. This script compiles the
row with fxfuse (which prints that measurement in the report's path) and with Inductor as users do,
then times the two compiled models with the same function after the compile, in both orders: if
the numbers after the compile differ from those inside it, the compile's timing is biased, not the
choice of what to time.

    python bench/whole_graph_timing.py --row S26
    python bench/whole_graph_timing.py --row S26 --inductor-first

``--inductor-first`` compiles and times Inductor's model before fxfuse's compile, then again after
it, after emptying the allocator's cache, after freeing cuBLAS's workspaces, and compiled anew; with
the GPU kernels of each Inductor run (torch.profiler): whether fxfuse's compile leaves state that
slows a model compiled before it, and which.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import fxfuse
from examples.suite import build
from fxfuse.graph_timing import time_both


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--row", default="S26")
    parser.add_argument("--inductor-first", action="store_true")
    args = parser.parse_args()
    if args.inductor_first:
        return inductor_first(args.row)
    torch.manual_seed(0)
    model, inputs = build(args.row, device="cuda", dtype=torch.bfloat16)
    fused = torch.compile(copy.deepcopy(model), backend="fxfuse")
    inductor = torch.compile(copy.deepcopy(model))
    fxfuse.reset_report()
    with torch.no_grad():
        fused(*inputs), inductor(*inputs)
    for row in fxfuse.last_report().rows:
        text = (row.path or "") + (row.reason or "")
        if "whole graph" in text:
            print("inside the compile:", text[text.index("whole graph"):])
            break
    else:
        print("inside the compile: not timed whole;", [(r.status, r.reason) for r in fxfuse.last_report().rows])
    print("after the compile, fxfuse first:", time_both(fused, inductor, inputs).describe())
    swapped = time_both(inductor, fused, inputs)
    print("after the compile, Inductor first (fused/Inductor swapped):", swapped.describe())


def inductor_first(row: str) -> None:
    """Inductor's model timed before fxfuse's compile and after it, with what might explain a
    difference removed one at a time."""
    from fxfuse.cuda.timing import time_candidates

    torch.manual_seed(0)
    model, inputs = build(row, device="cuda", dtype=torch.bfloat16)

    def gpu_us(compiled) -> float:
        with torch.no_grad():
            return time_candidates({"model": lambda: compiled(*inputs)})[0]["model"]

    def kernels(compiled) -> str:
        from torch.profiler import ProfilerActivity, profile

        with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                compiled(*inputs)
            torch.cuda.synchronize()
        rows = sorted((e for e in prof.key_averages() if e.device_time_total > 0),
                      key=lambda e: -e.device_time_total)[:6]
        return "\n".join(f"    {e.device_time_total / e.count:9.1f} us x{e.count // 20}  {e.key[:110]}" for e in rows)

    inductor = torch.compile(copy.deepcopy(model))
    with torch.no_grad():
        inductor(*inputs)
    print(f"Inductor, before fxfuse's compile: {gpu_us(inductor):.1f} us")
    print(kernels(inductor))
    fused = torch.compile(copy.deepcopy(model), backend="fxfuse")
    with torch.no_grad():
        fused(*inputs)
    print(f"fxfuse: {gpu_us(fused):.1f} us")
    print(f"Inductor, after fxfuse's compile: {gpu_us(inductor):.1f} us")
    print(kernels(inductor))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    print(f"Inductor, after emptying the allocator's cache: {gpu_us(inductor):.1f} us")
    torch._C._cuda_clearCublasWorkspaces()
    print(f"Inductor, after freeing cuBLAS's workspaces: {gpu_us(inductor):.1f} us")
    again = torch.compile(copy.deepcopy(model))
    with torch.no_grad():
        again(*inputs)
    print(f"Inductor compiled anew: {gpu_us(again):.1f} us; fxfuse: {gpu_us(fused):.1f} us")
    print(kernels(again))


if __name__ == "__main__":
    main()
