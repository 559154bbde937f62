"""Build every module the GPU tests use, in parallel worker processes (a script, not a test).

    python tests/gpu/prebuild.py [--suite] [--workers N]

Fills the build cache (FXFUSE_CACHE_DIR or ~/.cache/fxfuse) so that a later pytest run only loads
modules; useful where one command has a time limit. The modules of the kernel and in-GEMM tests'
cases, and those the model tests' compiles ask for (their MODELS, traced first in a process of its
own); ``--suite``: the suite models' modules too, as test_suite_cuda.py's compiles ask for them
(bench/prebuild_suite.py traces them, in processes of their own). Then one pool builds them all.
One line a module as it ends, with the count; the failures at the end, and a non-zero exit if any.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/support.py
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import fxfuse.cuda as fxcuda  # noqa: E402
from fxfuse.cuda import build  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def tests_jobs() -> list[build.BuildJob]:
    """The modules of tests/gpu's kernel and in-GEMM tests: a row module a (program, dtype), and
    the GEMM modules of the in-GEMM test files' cases (their menus: gemm_harness.gemm_jobs)."""
    import test_cuda_kernels
    import test_gemm_batch_norm
    import test_gemm_epilogue
    import test_gemm_group_norm
    from gemm_harness import gemm_jobs

    rows = [build.BuildJob(program.to_string(), dtype) for program, dtype in test_cuda_kernels.all_builds()]
    cases = {**{("epilogue", *key): case for key, case in test_gemm_epilogue.BUILDS.items()},
             **{("group norm", *key): case for key, case in test_gemm_group_norm.CASES.items()},
             **{("batch norm", *key): case for key, case in test_gemm_batch_norm.CASES.items()},
             **{("programmatic dependents", key): case for key, case in test_gemm_epilogue.PDL_BUILDS.items()}}
    return [*gemm_jobs(cases), *rows]


TRACED = Path(tempfile.gettempdir()) / "fxfuse-prebuild"  # the compiles' traced programs, by sources_digest
# the test files whose MODELS (model, inputs) the tests compile in float32 and bfloat16 (trace_models)
MODEL_TESTS = ("test_operands_cuda", "test_pooling_cuda")


def sources_digest(plan: list[str]) -> str:
    """What a trace under ``plan`` depends on: fxfuse's and the examples' Python sources, the
    tests' whose compiles it traces, and the plan."""
    digest = hashlib.sha256(" ".join(plan).encode())
    tests = ROOT / "tests"
    for path in sorted([*(ROOT / "fxfuse").rglob("*.py"), *(ROOT / "examples").rglob("*.py"),
                        tests / "gpu" / "test_suite_cuda.py", tests / "test_operands.py",
                        *(tests / "gpu" / f"{name}.py" for name in MODEL_TESTS)]):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:32]


def suite_plan() -> list[tuple[list[str], bool]]:
    """bench/prebuild_suite.py's arguments for the suite models test_suite_cuda.py compiles, each
    with whether its tests allow TF32 (a float32 chain has a GEMM module only then): every row at
    the small size in each dtype and under autocast; the full size's rows in bf16 and float32 (the
    symbolic-batch test's row with them), and the decode tests' rows and batches; S01 in float32
    with TF32 allowed (test_tf32_is_honoured_like_eager)."""
    from test_suite_cuda import DECODE_BATCHES, DECODE_ROWS, FULL_SIZE_ROWS, SYMBOLIC_BATCH_ROW

    decode = f"{','.join(DECODE_ROWS)}:{','.join(map(str, DECODE_BATCHES))}"
    full = ",".join(dict.fromkeys([*FULL_SIZE_ROWS, SYMBOLIC_BATCH_ROW]))
    return [(["--sizes", "small", "--dtypes", "fp32,bf16,fp16,autocast,autocast-fp16"], False),
            (["--sizes", "full", "--dtypes", "bf16,fp32", "--rows", full, "--decode", decode], False),
            (["--sizes", "small", "--dtypes", "fp32", "--rows", "S01"], True)]


def trace_plans(suite: bool) -> list[tuple[list[str], bool]]:
    """The traces of the GPU tests' compiles, each a script with its arguments (run in a process
    of its own, which writes what it traced to the path given after ``--trace-to``) and whether
    those tests allow TF32: the model tests' MODELS (this script's ``--trace-models``), and with
    ``suite`` test_suite_cuda.py's models (bench/prebuild_suite.py, suite_plan)."""
    plans = [([str(Path(__file__).resolve()), "--trace-models"], False)]
    suite_script = str(ROOT / "bench" / "prebuild_suite.py")
    return plans + ([([suite_script, *args], tf32) for args, tf32 in suite_plan()] if suite else [])


def trace_models(path: Path, device: str = "cuda") -> None:
    """Trace the MODELS of MODEL_TESTS as their tests compile them, in float32 and bfloat16 on
    ``device`` without gradients (the calls a GEMM module serves), and write their programs to
    ``path`` (bench/prebuild_suite.py's format)."""
    import importlib

    from bench.prebuild_suite import programs_of, write_traced

    pairs, gemms = set(), set()
    for name in MODEL_TESTS:
        for make_model, make_inputs in importlib.import_module(name).MODELS:
            for dtype in (torch.float32, torch.bfloat16):
                model = make_model().to(device=device, dtype=dtype).eval()
                inputs = [t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype) for t in make_inputs()]
                more_pairs, more_gemms = programs_of(model, inputs, device)
                pairs, gemms = pairs | more_pairs, gemms | more_gemms
    write_traced(path, pairs, gemms)
    print(f"{len(pairs)} programs of the model tests traced", flush=True)


def traced_jobs(suite: bool) -> list[build.BuildJob] | None:
    """The modules the GPU tests' compiles ask for (each plan of trace_plans traced in a process of
    its own, side by side), a module a program with the kernels for all its calls; None where
    tracing failed. Traced programs are kept by sources_digest. Called with TF32 allowed, so that
    build_jobs keeps the float32 GEMM modules the plans' own TF32 settings kept."""
    from bench.bench import tf32_allowed
    from bench.prebuild_suite import build_jobs, read_traced
    from fxfuse.cuda.engine import not_taken_reason

    TRACED.mkdir(parents=True, exist_ok=True)
    plans = trace_plans(suite)
    traced = [TRACED / f"{sources_digest(plan)}.json" for plan, _ in plans]
    tracers = [subprocess.Popen([sys.executable, *plan, "--trace-to", str(path.with_suffix(".partial"))])
               for (plan, _), path in zip(plans, traced) if not path.is_file()]
    if any(tracer.wait() != 0 for tracer in tracers):
        print("prebuild: tracing the tests' compiles failed")
        return None
    pairs, gemms = set(), set()
    for (_, tf32), path in zip(plans, traced):
        if not path.is_file():
            path.with_suffix(".partial").rename(path)
        more_pairs, more_gemms = read_traced(path)
        with tf32_allowed(tf32):  # the GEMM modules the plan's compiles ask for under its setting
            more_gemms = {item for item in more_gemms if not_taken_reason(*item[:2]) is None}
        pairs, gemms = pairs | more_pairs, gemms | more_gemms
    return build_jobs(pairs, gemms)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--suite", action="store_true", help="the suite models' modules too")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--trace-models", action="store_true",
                        help="only trace the model tests' compiles (trace_models), to --trace-to")
    parser.add_argument("--trace-to", type=Path, default=None)
    args = parser.parse_args()
    if args.trace_models:
        trace_models(args.trace_to)
        return 0
    if not fxcuda.available():
        print("CUDA or its toolchain is not available")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True  # the float32 in-GEMM cases are TF32 modules
    target = build.cuda_target(torch.device("cuda", torch.cuda.current_device()))
    start = time.time()

    failed_kinds: set[str] = set()  # each kind's first failure is shown as it happens: a fault of
    # every build shows in minutes, not in a summary a call's time limit may cut off

    def progress(job, error, done, total):
        what = f"{job.program[:60]} [{str(job.dtype).removeprefix('torch.')}]"
        family = "row" if job.param_dtypes is None else "GEMM"
        kind = "row module" if job.param_dtypes is None else f"GEMM module of {job.units()} kernels"
        print(f"prebuild: {done}/{total} at {time.time() - start:.0f} s: {'FAILED' if error else 'built'} "
              f"{kind} {what}", flush=True)
        if error and family not in failed_kinds:
            failed_kinds.add(family)
            print(f"prebuild: the first {family} module failed:\n{error[-2000:]}", flush=True)

    # what the model tests and test_suite_cuda.py compile, traced in processes of their own (under
    # a minute), or as traced before from the same sources; then the tests' and the suite's
    # modules in one pool, the GEMM modules of most kernels first (two pools in turn left most
    # cores idle through the first one's tail: a cold build took about 15 minutes of a 64-core
    # host, BENCHMARKS.md section 42)
    traced = traced_jobs(args.suite)
    if traced is None:
        return 1
    errors = build.build_many([*tests_jobs(), *traced], target, args.workers, on_built=progress)
    failed = {job: error for job, error in errors.items() if error}
    print(f"{len(errors)} modules ready in {time.time() - start:.0f} s on {torch.cuda.get_device_name()}, "
          f"{len(failed)} failed")
    for job, error in failed.items():
        print(f"FAILED {job.program} [{job.dtype}]\n{error}\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
