"""Where a fused op's time goes: the GEMM alone vs the fused op, per suite program, and the
epilogue's achieved bandwidth against its byte floor.

    python bench/epilogue_breakdown.py [--rows S01,S02] [--dtype bf16] [--once] [--selected]

Each suite row is traced on the GPU; every fused program is then called directly
(``torch.ops.fxfuse.linear_epilogue``) on fresh tensors of the traced shapes, so the numbers hold
the kernels alone (no Dynamo, no Inductor). ``--once`` calls each op once and prints nothing else:
the mode to run under a profiler (``ncu --clock-control none --kernel-name regex:apply_kernel|stats_kernel|combine_kernel``;
it prints the order of the calls). The sweep of apply plans behind Prog::kLocalItems (16-byte
chunks a thread of row-local programs) was run with a tuning flag since removed from the ABI; its
table is bench/results/plan_sweep_bf16.txt. ``--selected`` routes each program as the selection
does (the row path and the in-GEMM configurations timed, the fastest run; Inductor not timed) and
lists the GPU time of each kernel of the fused op per call (torch's profiler).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

import fxfuse.cuda as fxcuda  # noqa: E402
from bench.selection_timing import kernel_us  # noqa: E402
from examples import suite  # noqa: E402
from fxfuse.canonicalize import canonicalize  # noqa: E402
from fxfuse.match import example_value, match_all  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def traced_calls(row, dtype):
    """(program, x, weight, bias, params) of every fused chain of ``row`` at full size."""
    found = []

    def collect(gm, example_inputs, **kwargs):
        for chain in match_all(gm.graph, canonicalize(gm.graph), allow_cpu=False):
            if chain.program is None:
                continue

            def fresh(node, positive=False):
                value = example_value(node)
                if value is None:
                    return None
                t = torch.randn(tuple(value.shape), device="cuda", dtype=value.dtype)
                return t.abs() + 0.5 if positive else t

            f = chain.fusion
            found.append((f.program, fresh(f.x), fresh(f.weight) / 64, fresh(f.bias),
                          [fresh(p, positive=True) for p in f.params]))
        return gm.forward

    torch._dynamo.reset()
    model, inputs = suite.build(row, "full", "cuda", dtype)
    with torch.no_grad():
        torch.compile(model, backend=collect)(*inputs)
    return found


def gemm_and_fused_us(gemm, fused) -> tuple[float, float]:
    """GPU time per call of the bare GEMM and of the fused op, in µs, taken as the selection takes
    them (``timing.time_candidates``: CUDA-graph replays in blocks, each settling first, in order
    then in reverse). Timed apart, each after its own warm-up, the GEMM's time moved by up to
    10 % between two measurements on an H100 (the card's clock), which the epilogue's difference
    then carried whole."""
    from fxfuse.cuda.timing import time_candidates

    times, _ = time_candidates({"gemm": gemm, "fused": fused}, settle_s=0.2, passes=4)
    return times["gemm"], times["fused"]


def epilogue_bytes(program, m: int, n: int, element: int) -> int:
    """Read the GEMM output once and write the result once; a training BatchNorm reads it twice."""
    out = m * n if program.reduction is None else m
    reads = 2 if program.batch_norm_training else 1
    return reads * m * n * element + out * element


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="S01,S02,S03,S04,S06,S08,S11,S16,S17,S20,S21")
    parser.add_argument("--dtype", default="bf16", choices=DTYPES)
    parser.add_argument("--once", action="store_true")
    parser.add_argument("--selected", action="store_true", help="route as the selection does; list kernels")
    parser.add_argument("--bandwidth-gbs", type=float, default=4300.0, help="copy bandwidth for the floor")
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    table = []
    calls = [(row, call) for row in suite.select(args.rows.split(",")) for call in traced_calls(row, dtype)]
    failed = fxcuda.prepare_many({(call[0], dtype) for _, call in calls})  # all builds at once, in parallel
    for row, (program, x, w, b, params) in calls:
        if (program.to_string(), dtype) in failed:
            print(f"{row.id}: build failed: {failed[(program.to_string(), dtype)]}", flush=True)
            continue
        text = program.to_string()

        def fused(text=text, x=x, w=w, b=b, params=params):
            return torch.ops.fxfuse.linear_epilogue(text, x, w, b, params, False)

        m, n = x.numel() // x.shape[-1], w.shape[0]
        if args.selected:
            selection = fxcuda.select(program, dtype, tuple(p.dtype for p in params), (m, n, w.shape[1]), b is not None,
                                      tuple(tuple(p.shape) for p in params))
            print(f"{row.id}: {'cuBLAS + row pass' if selection is None else selection.describe()}", flush=True)
            for name, us in kernel_us(fused, ()).items():
                print(f"  {us:8.1f} us  {name if len(name) < 60 else name[:28] + '...' + name[-28:]}", flush=True)
        if args.once:
            print(f"call: {row.id} {text}", flush=True)
            fused()
            continue
        gemm_us, fused_us = gemm_and_fused_us(lambda x=x, w=w, b=b: torch.nn.functional.linear(x, w, b), fused)
        nbytes = epilogue_bytes(program, m, n, x.element_size())
        floor_us = nbytes / (args.bandwidth_gbs * 1e3)
        epi = fused_us - gemm_us
        table.append([row.id, f"{m}x{w.shape[1]}->{n}", f"{gemm_us:.1f}", f"{fused_us:.1f}",
                      f"{epi:.1f}", f"{floor_us:.1f}", f"{nbytes / max(epi, 1e-3) / 1e3:.0f}",
                      f"{fused_us / gemm_us:.3f}"])
    torch.cuda.synchronize()
    if table:
        print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  dtype {args.dtype}")
        print(tabulate(table, headers=["row", "shape", "GEMM us", "fused us", "epilogue us", "floor us",
                                       "epilogue GB/s", "fused/GEMM"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
