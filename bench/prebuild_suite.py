"""Build the CUDA modules of every suite program in parallel, ahead of tests and benchmarks.

    python bench/prebuild_suite.py [--sizes full,small] [--dtypes bf16,fp32,tf32,fp16,autocast,autocast-fp16]
                                   [--rows S01,...] [--trace-to JOBS.json]

Dynamo traces each suite model on the GPU, fxfuse's matcher names its programs, and
``fxfuse.cuda.prepare_many`` compiles all of them at once into the build cache, their in-GEMM
modules too (where the path takes the program), so that the compiles inside tests and the
benchmark only load modules (each compile builds only its own graph's modules, one graph after
another; here all cores work together). The dtypes are bench.py's: ``tf32`` traces the float32
models and builds with TF32 allowed, as a compile under it does (a float32 GEMM module is TF32,
and none is built while TF32 is off).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.bench import DTYPES as BENCH_DTYPES  # noqa: E402
from bench.bench import tf32_allowed  # noqa: E402
from examples import suite  # noqa: E402
from fxfuse.backend import param_dtypes, rows_of, wants_gemm_module  # noqa: E402
from fxfuse.canonicalize import canonicalize  # noqa: E402
from fxfuse.cuda import gemm_codegen  # noqa: E402
from fxfuse.cuda.build import BuildJob  # noqa: E402
from fxfuse.cuda.engine import gemm_modules_served, module_jobs  # noqa: E402
from fxfuse.ir import Program  # noqa: E402
from fxfuse.match import match_all  # noqa: E402

# name -> (the model's dtype, autocast's dtype or None): bench.py's --dtype choices (its TF32 ones
# built with TF32 allowed, main), and autocast(fp16) over the float32 model, which the tests run
DTYPES = {name: (spec.param_dtype, spec.autocast) for name, spec in BENCH_DTYPES.items()}
DTYPES["autocast-fp16"] = (torch.float32, torch.float16)
TF32 = {name for name, spec in BENCH_DTYPES.items() if spec.tf32}


def suite_programs(rows, sizes, dtypes, device: str = "cuda", batches=()) -> tuple[set, set]:
    """(program, dtype) of every fused chain of ``rows`` at ``sizes`` in ``dtypes`` (DTYPES
    values), on ``device``, and (program, dtype, parameter dtypes, rows) of each for its GEMM
    module, as the backend asks for it (for calls of each of ``batches`` rows instead, where
    given: the decode tests' inputs of the model's features)."""
    found, gemms = set(), set()
    for row in rows:
        for size in sizes:
            mod = suite.load(row)
            if size not in mod.SIZES:
                continue
            for dtype, autocast in dtypes:
                model, inputs = suite.build(row, size, device, dtype)
                more_found, more_gemms = programs_of(model, inputs, device, autocast, batches)
                found, gemms = found | more_found, gemms | more_gemms
                del model, inputs
    return found, gemms


def programs_of(model: torch.nn.Module, inputs: list, device: str = "cuda", autocast: torch.dtype | None = None,
                batches=()) -> tuple[set, set]:
    """(program, dtype) of every fused chain of ``model`` called on ``inputs`` (without
    gradients, under ``autocast`` where given), and (program, dtype, parameter dtypes, rows) of
    each for its GEMM module, as the backend asks for it (for calls of each of ``batches`` rows
    instead, where given). Traced by Dynamo; nothing is built."""
    found, gemms = set(), set()

    def collect(gm, example_inputs, **kwargs):
        for chain in match_all(gm.graph, canonicalize(gm.graph), allow_cpu=device == "cpu"):
            if chain.program is not None:
                found.add((chain.program, chain.dtype))
                for calls in (batches or [rows_of(chain)]) if wants_gemm_module(chain) else ():
                    gemms.add((chain.program, chain.dtype, param_dtypes(chain), calls))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad(), torch.autocast(device, dtype=autocast, enabled=autocast is not None):
        torch.compile(model, backend=collect)(*inputs)
    return found, gemms


def build_jobs(pairs, gemms) -> list[BuildJob]:
    """The builds of suite_programs's modules, as prepare_many would compile them in one process:
    each GEMM module with the kernels for every call of its program."""
    menus = [(item, gemm_codegen.menu(Program.parse(item[0]), calls)) for item, calls in gemm_modules_served(gemms).items()]
    return module_jobs([(program.to_string(), dtype) for program, dtype in pairs], menus)


def write_traced(path: Path, pairs, gemms) -> None:
    """suite_programs's (pairs, gemms) as JSON, for a process that builds them with others'."""
    def name(dtype):
        return str(dtype).removeprefix("torch.")

    path.write_text(json.dumps({"pairs": [[program.to_string(), name(dtype)] for program, dtype in pairs],
                                "gemms": [[program.to_string(), name(dtype), [name(d) for d in params], rows]
                                          for program, dtype, params, rows in gemms]}))


def read_traced(path: Path) -> tuple[set, set]:
    traced = json.loads(path.read_text())
    return ({(Program.parse(text), getattr(torch, dtype)) for text, dtype in traced["pairs"]},
            {(Program.parse(text), getattr(torch, dtype), tuple(getattr(torch, d) for d in params), rows)
             for text, dtype, params, rows in traced["gemms"]})


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="full,small")
    parser.add_argument("--dtypes", default=",".join(d for d in DTYPES if d not in TF32))
    parser.add_argument("--rows", default=None)
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--decode", default=None, metavar="ROWS:BATCHES",
                        help="also these rows' modules at full size in bf16 for calls of these rows, as "
                             "tests/gpu/test_suite_cuda.py's decode tests make them (S01,S04:1,16)")
    parser.add_argument("--trace-to", type=Path, default=None,
                        help="trace only, and write the programs (read_traced) to this JSON file: tests/gpu/prebuild.py "
                             "--suite builds them with the tests' own")
    args = parser.parse_args()
    import fxfuse.cuda as fxcuda

    rows = [r for r in suite.select(args.rows.split(",") if args.rows else None) if "-M" not in r.id]
    dtypes = args.dtypes.split(",")
    start = time.time()
    pairs, gemms = suite_programs(rows, args.sizes.split(","), [DTYPES[d] for d in dtypes])
    if args.decode:
        decode_rows, batches = args.decode.split(":")
        _, decode_gemms = suite_programs(suite.select(decode_rows.split(",")), ["full"], [DTYPES["bf16"]],
                                         batches=[int(b) for b in batches.split(",")])
        gemms |= decode_gemms
    traced = time.time() - start
    if args.trace_to is not None:
        write_traced(args.trace_to, pairs, gemms)
        print(f"{len(pairs)} suite programs traced in {traced:.0f} s", flush=True)
        return 0
    print(f"{len(pairs)} programs ({len(gemms)} with their parameters' dtypes) traced in {traced:.0f} s; building",
          flush=True)  # a run stopped during the builds still says where its time went
    with tf32_allowed(bool(TF32 & set(dtypes))):  # the float32 GEMM modules, as such compiles ask
        failed = fxcuda.prepare_many(sorted(pairs, key=str), workers=args.workers, gemm_items=sorted(gemms, key=str))
    print(f"{len(pairs)} suite programs' modules ready in {time.time() - start:.0f} s "
          f"(tracing {traced:.0f} s), {len(failed)} failed")
    for (program, dtype), error in failed.items():
        print(f"FAILED {program} [{dtype}]\n{error}\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
