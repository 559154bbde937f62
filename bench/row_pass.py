"""The row pass alone: fxfuse's program module against Inductor's kernels for the same epilogue,
and against a copy of the GEMM output (the pass's byte floor), per program and shape (CUDA GPU).

    python bench/row_pass.py [--rows s20_layer_silu,s21_rms_silu] [--shape 4096,4096] [--k 64]

Each program of tests/gpu/programs.py runs on the GEMM output of ``x @ w.T + b`` with a short K
(``--k``, 64 by default), so that the GEMM is a small part of each path and the pass's cost reads
clearly: ``F.linear`` alone, fxfuse's row path (cuBLAS + the program's row pass) and Inductor's
chain (its cuBLAS GEMM + the kernels it generates, as the selection compiles it:
``engine.inductor_chain``), all timed as the selection times (CUDA-graph replays, blocks after a
warm-up: ``timing.time_candidates``). A pass's cost is its path less ``F.linear``; ``copy`` is
``y.clone()`` of the same output, a read and a write of every byte, the floor of a pass that
writes an output of the GEMM's size.

``--profile`` times nothing: each path runs once between cudaProfilerStart and Stop for ncu
(``ncu --clock-control none --profile-from-start off --kernel-name regex:'apply_kernel|triton' ...``), in the order
printed (bench/gemm_configs.py's ``profile_once``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tabulate import tabulate  # noqa: E402

# the wide row statistics and row maps, where the pass carries the most arithmetic
DEFAULT_ROWS = "identity,s20_layer_silu,s21_rms_silu,s11_gelu_softmax"


def main(argv=None) -> int:
    import fxfuse.cuda as fxcuda
    from fxfuse.cuda.engine import inductor_chain
    from fxfuse.cuda.timing import time_candidates
    from fxfuse.ir import Gemm, Program

    from bench.gemm_configs import parse_shapes, problem, profile_once
    import programs

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=DEFAULT_ROWS,
                   help="programs of tests/gpu/programs.py: PROGRAMS' names or its constants' ('identity': none)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--shape", default="4096,4096;1024,8192", help="M,N (several: separated by ';')")
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--profile", action="store_true", help="run each path once for ncu instead of timing")
    args = p.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]

    def program_named(name: str) -> Program:
        return Program(Gemm(True), ()) if name == "identity" else programs.PROGRAMS.get(name) or getattr(programs, name)

    chosen = {name: program_named(name) for name in args.rows.split(",")}
    failed = fxcuda.prepare_many([(prog, dtype) for prog in chosen.values()])
    assert not failed, failed
    device = torch.device("cuda", torch.cuda.current_device())
    rows = []
    with torch.no_grad():
        for m, n in parse_shapes(args.shape):
            for name, prog in chosen.items():
                x, w, b, params = problem(prog, m, n, args.k, dtype, device, seed=0)
                bias = b if prog.gemm.bias else None
                y = F.linear(x, w, bias)
                text = prog.to_string()
                calls = {
                    "F.linear": lambda: F.linear(x, w, bias),
                    "copy": y.clone,
                    "fxfuse": lambda: fxcuda.engine.call(text, x, w, bias, params)[0],
                    "inductor": inductor_chain(prog, x, w, bias, params),
                }
                if args.profile:
                    profile_once(f"{name} {m}x{n}", [(k, v) for k, v in calls.items() if k != "F.linear"])
                    continue
                times, _ = time_candidates(calls, settle_s=0.2, passes=4)
                base = times["F.linear"]
                fx_pass, ind_pass = times["fxfuse"] - base, times["inductor"] - base
                rows.append([name, f"{m}x{n}", f"{base:.1f}", f"{times['copy']:.1f}", f"{fx_pass:.1f}",
                             f"{ind_pass:.1f}", f"{fx_pass / times['copy']:.2f}", f"{fx_pass / ind_pass:.2f}"])
                print(" ".join(rows[-1]), flush=True)
    if args.profile:
        return 0
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  {args.dtype}  K = {args.k}  "
          f"us per call (CUDA graph); pass = path - F.linear")
    print(tabulate(rows, headers=["program", "M x N", "F.linear", "copy", "fxfuse pass", "Inductor pass",
                                  "fx / copy", "fx / ind"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
