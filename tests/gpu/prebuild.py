"""Build every module the GPU tests use, in parallel worker processes (a script, not a test).

    python tests/gpu/prebuild.py [--workers 8]

Fills the build cache (FXFUSE_CACHE_DIR or ~/.cache/fxfuse) so that a later pytest run only loads
modules; useful where one command has a time limit. Prints the failures and exits non-zero if any.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/support.py
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import fxfuse.cuda as fxcuda  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=None)
    args = parser.parse_args()
    if not fxcuda.available():
        print("CUDA or its toolchain is not available")
        return 2
    import sanitize
    import test_cuda_kernels
    import test_gemm_batch_norm
    import test_gemm_epilogue
    import test_gemm_group_norm
    from gemm_harness import build_menu_modules, param_dtypes

    # the in-GEMM tests' modules: a row module and a GEMM module per (program, dtype), as
    # gemm_harness.build_modules builds them
    in_gemm = [*test_gemm_epilogue.BUILDS.values(), *test_gemm_group_norm.CASES.values(),
               *test_gemm_batch_norm.CASES.values(), *[(sanitize.PROGRAMS[n], d) for n, d, *_ in sanitize.GEMM_CALLS]]
    torch.backends.cuda.matmul.allow_tf32 = True  # the float32 in-GEMM cases are TF32 modules (test_gemm_epilogue)
    pairs = (test_cuda_kernels.all_builds() + [(sanitize.PROGRAMS[n], d) for n, d, *_ in sanitize.CALLS]
             + in_gemm)
    gemms = [(program, dtype, param_dtypes(program, dtype)) for program, dtype in in_gemm]
    start = time.time()
    failed = fxcuda.prepare_many(pairs, workers=args.workers, gemm_items=[(*gemm, None) for gemm in gemms])
    unique = len({(p.to_string(), d) for p, d in pairs}) + len({(p.to_string(), d) for p, d in in_gemm})
    device = torch.device("cuda", torch.cuda.current_device())
    for program, dtype, params in gemms:
        if fxcuda.engine.prepare_gemm(program, dtype, params, device) is None:
            failed[(program.to_string(), dtype)] = fxcuda.engine.gemm_error(program, dtype, params, device)
    # the programmatic-dependent kernel's modules (not the production menu: test_gemm_epilogue builds them itself)
    pdl = {name: test_gemm_epilogue.PROGRAMS[name] for name in test_gemm_epilogue.PDL}
    try:
        build_menu_modules(pdl, torch.bfloat16, test_gemm_epilogue.PDL_MENU)
    except Exception as error:  # noqa: BLE001 - reported with the others
        failed[("programmatic-dependent modules", torch.bfloat16)] = error
    unique += len(pdl)
    print(f"{unique} modules ready in {time.time() - start:.0f} s on {torch.cuda.get_device_name()}, {len(failed)} failed")
    for (program, dtype), error in failed.items():
        print(f"FAILED {program} [{dtype}]\n{error}\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
