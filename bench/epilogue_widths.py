"""One fused program's epilogue time across output widths N: where a row plan loses bandwidth.

    python bench/epilogue_widths.py [--m 8192] [--k 4096] [--n 4096,11008,11264] [--dtype bf16]
                                    [PROGRAM ...]

For each program text (default: S26's gate chain with and without its full operand, and its down projection's residual add) and each N,
the GEMM alone (F.linear) and the fused op are timed back to back; the table shows the epilogue's
time (fused - GEMM), its bytes (the GEMM output read, every full operand read, the output written)
and the bandwidth reached.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

import fxfuse.cuda as fxcuda  # noqa: E402
from bench.epilogue_breakdown import DTYPES, event_us  # noqa: E402
from fxfuse.ir import Program  # noqa: E402

DEFAULT_PROGRAMS = [
    "linear(bias=False) | pointwise(bf16(bf16(silu(x)) * p0)) || full",
    "linear(bias=False) | pointwise(bf16(silu(x)))",
    "linear(bias=False) | pointwise(bf16(x + p0)) || full",
]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("programs", nargs="*", default=DEFAULT_PROGRAMS)
    parser.add_argument("--m", type=int, default=8192)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--n", default="4096,11008,11264,16384")
    parser.add_argument("--dtype", default="bf16", choices=DTYPES)
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    rows = []
    for text in args.programs:
        program = Program.parse(text)
        fxcuda.prepare(program, dtype)
        for n in map(int, args.n.split(",")):
            x = torch.randn(args.m, args.k, device="cuda", dtype=dtype)
            w = torch.randn(n, args.k, device="cuda", dtype=dtype) / 64
            kinds = program.params
            params = [torch.randn(args.m, n, device="cuda", dtype=dtype) if kind == "full"
                      else torch.randn(n, device="cuda", dtype=dtype) for kind in kinds]
            gemm_us = event_us(lambda: torch.nn.functional.linear(x, w))
            fused_us = event_us(lambda: torch.ops.fxfuse.linear_epilogue(program.to_string(), x, w, None, params, False))
            nbytes = (2 + sum(kind == "full" for kind in kinds)) * args.m * n * x.element_size()
            epi = fused_us - gemm_us
            rows.append([text[:60], n, f"{gemm_us:.1f}", f"{fused_us:.1f}", f"{epi:.1f}",
                         f"{nbytes / max(epi, 1e-3) / 1e3:.0f}"])
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  dtype {args.dtype}  M {args.m}  K {args.k}")
    print(tabulate(rows, headers=["program", "N", "GEMM us", "fused us", "epilogue us", "epilogue GB/s"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
