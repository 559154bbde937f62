"""What the selection measured against what the kernels take in the model (Hopper GPU).

    python bench/selection_timing.py [--rows S26] [--dtype bf16]

Compiles each suite row (eval, no grad) with fxfuse's default policy and records every candidate
set the selection times while the graph compiles, timed there by both methods: launches of 10
calls between CUDA events, and replays of a CUDA graph of 10 calls (the selection's own). Once
the compile is over each set is timed again by both. Then the model compiled by fxfuse and by
Inductor runs under the profiler: every kernel's GPU time per forward. The selection's verdict
holds where a candidate's time at selection matches the time of its kernels in the model.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
CALLS = 20  # forwards under the profiler


def kernel_us(fn, inputs) -> dict[str, float]:
    """GPU µs per forward of each kernel ``fn`` launches (settled first)."""
    for _ in range(3):
        fn(*inputs)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn(*inputs)
        torch.cuda.synchronize()
    totals: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time > 0:
            totals[event.name] += event.device_time / CALLS
    return dict(totals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="S26")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    args = parser.parse_args()

    import fxfuse
    from examples.suite import build, select

    from fxfuse.cuda import timing

    engine = importlib.import_module("fxfuse.cuda.engine")  # the module; fxfuse.cuda.engine is the Engine
    recorded: list[tuple[dict, dict, dict]] = []
    graph_timed = engine.time_candidates

    def both_methods(calls, **options):  # the screen's call, and the final's (settle_s, warm_up_s)
        launches = timing.blocked_medians(calls, timing.time_us)
        times, method = graph_timed(calls, **options)
        recorded.append((calls, launches, times))
        return times, method

    engine.time_candidates = both_methods
    for row in select(args.rows.split(",")):
        recorded.clear()
        torch._dynamo.reset()
        torch.manual_seed(0)
        model, inputs = build(row, device="cuda", dtype=DTYPES[args.dtype])
        with torch.no_grad():
            fused = torch.compile(model, backend="fxfuse")
            fused(*inputs)
            print(fxfuse.last_report())
            for calls, launches_at_compile, graphs_at_compile in recorded:
                launches = timing.blocked_medians(calls, timing.time_us)
                graphs, _ = graph_timed(calls)
                print(f"\n{row.id}: {len(calls)} candidates, µs per call")
                print(f"  {'candidate':58s} {'launches':>9s} {'graph':>9s} {'launches':>9s} {'graph':>9s}")
                print(f"  {'':58s} {'(compile)':>9s} {'(compile)':>9s} {'(after)':>9s} {'(after)':>9s}")
                for name in sorted(calls, key=graphs.get):
                    print(f"  {name:58s} {launches_at_compile[name]:9.1f} {graphs_at_compile[name]:9.1f} "
                          f"{launches[name]:9.1f} {graphs[name]:9.1f}")
            inductor = torch.compile(model)
            for name, fn in (("fxfuse", fused), ("Inductor", inductor)):
                times = kernel_us(fn, inputs)
                print(f"\n{row.id}, {name}: {sum(times.values()):.1f} µs of kernels per forward")
                for kernel, us in sorted(times.items(), key=lambda kv: -kv[1])[:12]:
                    print(f"  {us:9.1f}  {kernel[:110]}")
        del model, inputs, fused
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
