"""How the selection's timing method moves its verdict (Hopper GPU).

    python bench/selection_timing.py [--rows S26] [--dtype bf16]

Compiles each suite row with fxfuse (default policy) and records every candidate set the selection
times while the graph compiles. Each set is timed there by both methods, launches of 10 calls
between CUDA events and replays of a CUDA graph of 10 calls, and again by both once the compile
is over (the host quiet), round-robin, median of 7. A method that reads a candidate slower during
the compile than after it measures the host, not the kernels.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="S26")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    args = parser.parse_args()

    import fxfuse  # noqa: F401 - registers the backend
    from examples.suite import build, select
    from fxfuse.cuda import engine

    recorded: list[tuple[dict, dict, dict]] = []
    graph_timed = engine.time_candidates

    def both_methods(calls):
        launches = engine.interleaved_medians(calls, engine.time_us)
        times, timing = graph_timed(calls)
        recorded.append((calls, launches, times))
        return times, timing

    engine.time_candidates = both_methods
    for row in select(args.rows.split(",")):
        recorded.clear()
        torch.manual_seed(0)
        model, inputs = build(row, device="cuda", dtype=DTYPES[args.dtype])
        with torch.no_grad():
            torch.compile(model, backend="fxfuse")(*inputs)
        torch.cuda.synchronize()
        for calls, launches_at_compile, graphs_at_compile in recorded:
            launches = engine.interleaved_medians(calls, engine.time_us)
            graphs, _ = graph_timed(calls)
            print(f"{row.id}: {len(calls)} candidates, us per call")
            print(f"  {'candidate':44s} {'launches':>10s} {'graph':>10s} {'launches':>10s} {'graph':>10s}")
            print(f"  {'':44s} {'(compile)':>10s} {'(compile)':>10s} {'(after)':>10s} {'(after)':>10s}")
            for name in sorted(calls, key=graphs.get):
                print(f"  {name:44s} {launches_at_compile[name]:10.1f} {graphs_at_compile[name]:10.1f} "
                      f"{launches[name]:10.1f} {graphs[name]:10.1f}")
        print(fxfuse.last_report())
        del model, inputs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
