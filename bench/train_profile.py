"""Where a training step's time goes: every GPU kernel of forward + backward, per variant.

    python bench/train_profile.py [--rows S01,S03] [--dtype autocast|fp32|bf16] [--top 12]

For every row, each variant of bench/train_bench.py (eager, Inductor, fxfuse; fxfuse with the
default policy unless ``--policy always``) is compiled and settled, then ``STEPS`` forward + backward
passes run under torch.profiler; the kernels' GPU time is summed per kernel name and per class
(GEMM, the rest), divided by the steps. Beside it: the CPU time to enqueue a step (``STEPS`` steps
timed without a synchronisation) and the wall time of a step. A step takes about the larger of its
kernels' time and its CPU time; the GEMM share against the rest bounds what any epilogue work can
gain. A miss of the training target is read off this table.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from tabulate import tabulate

from bench.train_bench import VARIANTS, Compile, Step, model_and_inputs, variant

STEPS = 5
GEMM_MARKERS = ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")


def is_gemm(name: str) -> bool:
    return any(marker in name.lower() for marker in GEMM_MARKERS)


def kernel_times(step: Step) -> dict[str, tuple[int, float]]:
    """``{kernel name: (launches, µs)}`` per forward + backward."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step.forward_backward()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time > 0:
            entry = totals[event.name]
            entry[0] += 1
            entry[1] += event.device_time
    return {name: (int(n / STEPS), us / STEPS) for name, (n, us) in totals.items()}


def cpu_and_wall_us(step: Step, rounds: int = 5) -> tuple[float, float]:
    """Median over ``rounds`` of (CPU µs to enqueue a step, wall µs of a step), ``STEPS`` steps each."""
    cpu, wall = [], []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(STEPS):
            step.forward_backward()
        enqueued = time.perf_counter()
        torch.cuda.synchronize()
        done = time.perf_counter()
        cpu.append((enqueued - start) / STEPS * 1e6)
        wall.append((done - start) / STEPS * 1e6)
    return statistics.median(cpu), statistics.median(wall)


def profile_row(row: str, dtype: str, top: int, how: Compile) -> tuple[list, str]:
    """The row's summary lines (one a variant) and its per-kernel tables."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, fresh = model_and_inputs(row, dtype)
    inputs = fresh()
    summary, details = [], []
    for name in VARIANTS:
        step = Step(*variant(model, name, how), dtype, [t.clone() for t in inputs])
        for _ in range(3):
            step.forward_backward()
        kernels = kernel_times(step)
        cpu, wall = cpu_and_wall_us(step)
        gemm = sum(us for k, (_, us) in kernels.items() if is_gemm(k))
        total = sum(us for _, us in kernels.values())
        launches = sum(n for k, (n, _) in kernels.items() if not is_gemm(k))
        summary.append([row, name, f"{total:.0f}", f"{gemm:.0f}", f"{total - gemm:.0f}", launches,
                        f"{cpu:.0f}", f"{wall:.0f}"])
        ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]
        details.append(f"== {row} {dtype} {name}")
        details.append(tabulate([[n, f"{us:.1f}", k[:110]] for k, (n, us) in ranked], headers=["launches", "µs", "kernel"]))
        del step
    return summary, "\n".join(details)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="S01,S03,S08,S20")
    parser.add_argument("--dtype", default="autocast", choices=("fp32", "autocast", "bf16"))
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--policy", default="fastest", choices=("fastest", "always"))
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    summary, details = [], []
    for row in args.rows.split(","):
        print(f"[train_profile] {row}", file=sys.stderr, flush=True)
        row_summary, row_details = profile_row(row, args.dtype, args.top, Compile(args.policy))
        summary += row_summary
        details.append(row_details)
    print(f"{datetime.date.today()}  {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"dtype {args.dtype}  fxfuse policy {args.policy}  (µs per forward + backward)\n")
    print(tabulate(summary, headers=["row", "variant", "kernels", "GEMM", "rest", "launches\n(rest)",
                                     "CPU\nenqueue", "wall"]))
    print("\n" + "\n".join(details))
    return 0


if __name__ == "__main__":
    sys.exit(main())
