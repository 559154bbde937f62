"""One small call of each kernel template, for compute-sanitizer (a script, not a test).

    python tests/gpu/sanitize.py --build-only          # build the modules first (no sanitizer)
    compute-sanitizer --tool memcheck  python tests/gpu/sanitize.py
    compute-sanitizer --tool racecheck python tests/gpu/sanitize.py
    compute-sanitizer --tool synccheck python tests/gpu/sanitize.py

Covers the row kernel (aligned and unaligned paths, several rows a block, multi-warp rows, group
norm by lane shuffles, by warps, by chunk and staged in shared memory, row reductions (var about
the mean), normalize, chains that widen to a float32 output in both chunk layouts), the BatchNorm
statistics and combine kernels, and the backward kernels of pointwise and row programs (16-byte
and 1-element paths, many chunks of rows, a column parameter, group norms by lanes, layer norms
over several warps, row maps over 256 threads and normalize's, reductions with std's), and the
rotary embedding (partners by lane shuffles and through shared memory); on Hopper, each kernel of
the in-GEMM modules of a pointwise chain, an eval BatchNorm folded into it, an operand of the
output's shape, the gated pair, a row reduction, GroupNorm in the tile, a training BatchNorm
(its moments, finalize and normalizing pass) and the row maps (LayerNorm, RMSNorm, softmax: their
(row, subtile) partials and the pass a row). Prints one line per call and exits non-zero on a
mismatch with the reference.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/support.py
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import fxfuse.cuda as fxcuda  # noqa: E402
from fxfuse import reference  # noqa: E402
from fxfuse.cuda.build import cuda_target, gemm_target_reason  # noqa: E402
from gemm_harness import (assert_under_rule, draw, kernels, param_dtypes, run_config_outputs, truth,  # noqa: E402
                          truth_statistics)
from programs import PROGRAMS, assert_backward_close, make_params  # noqa: E402

CALLS = [  # (program, dtype, M, N, K)
    ("s04_group_silu_vec_silu", torch.bfloat16, 5, 256, 16),  # aligned, 8 rows a block, GN by lane shuffles
    ("s02_group_leaky_double", torch.float32, 3, 4096, 16),  # GN by warps (a group of 256 threads)
    ("s04_group_silu_vec_silu", torch.float32, 3, 1000, 16),  # unaligned tail, GN staged (group of 125)
    ("group_odd", torch.float32, 3, 1000, 16),  # GN by chunk partials in shared memory (group of 200)
    ("s11_gelu_softmax", torch.bfloat16, 3, 4096, 16),  # a multi-warp row
    ("reduce_logsumexp_keep", torch.float16, 7, 1000, 16),  # row reduction, scalar output
    ("s03_batch_train_gelu_relu", torch.bfloat16, 37, 200, 16),  # BN statistics + combine + row
    ("s07_vec_batch_train", torch.float32, 9, 1000, 16),  # BN with a pre-BN pointwise, unaligned
    ("s16_sigmoid_sum", torch.bfloat16, 2, 32768, 16),  # the widest row
    ("widen_s08_silu_vec_group", torch.bfloat16, 5, 256, 16),  # bf16 in, float32 out: two stores a chunk
    ("widen_s20_layer_silu", torch.float16, 3, 1000, 16),  # widened, unaligned tail: one element at a time
    ("widen_s07_vec_batch_train", torch.bfloat16, 37, 200, 16),  # widened BN statistics + combine + row
    ("widen_s09_vec_relu", torch.bfloat16, 7, 1000, 16),  # chunks of 4 values: 8-byte loads, one store
    ("pool_avg_overlapping_rows", torch.bfloat16, 40, 256, 16),  # pooling through shared memory, many rows a block
    ("pool_max_sum_scale", torch.float32, 3, 4096, 16),  # pooling of a multi-warp row, then a reduction
    ("reduce_var_keep", torch.float32, 5, 4096, 16),  # two passes about the mean of a multi-warp row
    ("normalize_then_col", torch.float32, 7, 1000, 16),  # a row map over its norm, unaligned tail
    ("rotary_heads", torch.bfloat16, 37, 256, 16),  # rotary embedding, many rows a block
    ("rotary_between_pointwise", torch.float32, 5, 4096, 16),  # rotary embedding by lane shuffles
    ("rotary_heads_of_24", torch.bfloat16, 5, 4800, 16),  # rotary embedding through shared memory
    ("where_leaky", torch.bfloat16, 7, 1000, 16),  # comparisons and picks, unaligned tail
    ("mask_below_col", torch.float32, 5, 4096, 16),  # a mask against a per-column threshold
]
GEMM_CALLS = [  # (program, dtype, M, N, K): each kernel of the program's in-GEMM module once
    ("s01_scale_leaky", torch.bfloat16, 300, 1032, 520),  # pointwise; M, N and K past the tiles
    ("s22_batch_eval_relu", torch.bfloat16, 300, 1032, 520),  # eval BatchNorm, folded into the pointwise stage
    ("full_residual", torch.bfloat16, 300, 1032, 520),  # an operand of the output's shape: TMA loads
    ("gemm_gate_silu", torch.bfloat16, 300, 1032, 520),  # the gated pair: two GEMMs, interleaved weights
    ("s05_logsumexp_chain", torch.bfloat16, 300, 1032, 520),  # a row reduction: partials, then the finalize
    ("s04_group_silu_vec_silu", torch.bfloat16, 300, 512, 520),  # GroupNorm of 64 columns in the tile
    ("s07_vec_batch_train", torch.bfloat16, 300, 1032, 520),  # training BatchNorm: moments, finalize, normalize
    ("s20_layer_silu", torch.bfloat16, 300, 1032, 520),  # LayerNorm: (row, subtile) moments, then a pass a row
    ("s21_rms_silu", torch.bfloat16, 300, 1032, 520),  # RMSNorm: (row, subtile) sums of squares, then a pass
    ("s11_gelu_softmax", torch.bfloat16, 300, 1032, 520),  # softmax: (row, subtile) max and sum, then a pass
]
GRAD_CALLS = [  # (program, dtype, M, N) of the backward kernel
    ("s01_scale_leaky", torch.bfloat16, 300, 256),  # 16-byte path, many chunks of rows a column
    ("vocabulary_2", torch.float32, 77, 1000),  # 16-byte path, a column parameter
    ("s14_silu_div_clamp_tanh", torch.float32, 50, 999),  # 1-element path (odd width)
    ("widen_s08_silu_vec_group", torch.bfloat16, 300, 512),  # norm kernel: row-local group norm, strips
    ("s20_layer_silu", torch.float32, 33, 2048),  # norm kernel: a row over several warps
    ("s21_rms_silu", torch.float32, 9, 999),  # norm kernel: 1-element path
    ("s22_batch_eval_relu", torch.bfloat16, 300, 1024),  # eval BatchNorm: row-local, column statistics
    ("vec_batch_eval_silu_scalar", torch.float32, 33, 1000),  # eval BatchNorm with pre and post parameters
    ("s11_gelu_softmax", torch.bfloat16, 40, 8192),  # row map: a row over 256 threads
    ("widen_s05_logsumexp_chain", torch.bfloat16, 70, 1000),  # reduction, float32 output, 8-byte chunks
    ("reduce_max_first_drop", torch.float32, 9, 999),  # reduction: the first maximum, 1-element path
    ("reduce_std_drop", torch.float32, 33, 2048),  # reduction: std about the mean, several warps
    ("normalize_no_eps", torch.float32, 9, 999),  # row map: the norm's path, 1-element path
    ("where_leaky", torch.bfloat16, 77, 1000),  # picks: the gradient of the picked branch only
]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--build-only", action="store_true")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    gemm_items = [(PROGRAMS[name], dtype, param_dtypes(PROGRAMS[name], dtype)) for name, dtype, *_ in GEMM_CALLS]
    if not gemm_available():
        gemm_items = []
    if args.build_only:  # in parallel worker processes; the sanitized run then loads them
        failed = fxcuda.prepare_many(list({(PROGRAMS[name], dtype) for name, dtype, *_ in CALLS + GRAD_CALLS}),
                                     gemm_items=[(*item, None) for item in gemm_items])
        for (program, dtype), error in failed.items():
            print(f"BUILD FAILED {program} {dtype}: {error}", flush=True)
        return 1 if failed else 0
    for name, dtype, *_ in CALLS + GRAD_CALLS:
        fxcuda.prepare(PROGRAMS[name], dtype)
    failures = 0
    for name, dtype, m, n, k in CALLS:
        program = PROGRAMS[name]
        g = torch.Generator().manual_seed(0)
        x = torch.randn(m, k, generator=g).to("cuda", dtype)
        w = (torch.randn(n, k, generator=g) / math.sqrt(k)).to("cuda", dtype)
        b = torch.randn(n, generator=g).to("cuda", dtype) if program.gemm.bias else None
        params = make_params(program, n, dtype=dtype, device="cuda", generator=g, lead=(m,))
        ref, _ = reference.forward(program, x, w, b, params)
        result = fxcuda.engine.forward_kernels(program.to_string(), x, w, b, params)
        torch.cuda.synchronize()
        tol = 1e-4 if dtype == torch.float32 else 1e-2
        ok = result is not None and torch.allclose(result[0], ref, rtol=tol, atol=tol, equal_nan=True)
        failures += not ok
        print(f"{'ok' if ok else 'MISMATCH':8} {name} {str(dtype)[6:]} {m}x{k}x{n}", flush=True)
    failures += run_gemm_calls(gemm_items)
    for name, dtype, m, n in GRAD_CALLS:
        program = PROGRAMS[name]
        g = torch.Generator().manual_seed(0)
        y = torch.randn(m, n, generator=g).to("cuda", dtype)
        grad = torch.randn(program.output_shape((m,), n), generator=g).to("cuda", program.output_dtype(dtype))
        params = make_params(program, n, dtype=dtype, device="cuda", generator=g)
        got = fxcuda.engine.backward_kernel(program.to_string(), grad, y, params)
        torch.cuda.synchronize()
        tol = 1e-4 if dtype == torch.float32 else 1e-2
        try:  # the GPU tests' comparison (tests/gpu/test_cuda_kernels.py)
            assert got is not None, "the backward kernel did not run"
            assert_backward_close(program, got, reference.epilogue_backward(program, grad, y, params), tol,
                                  col_atol=tol * m ** 0.5, scalar_atol=tol * (m * n) ** 0.5)
            ok = True
        except AssertionError:
            ok = False
        failures += not ok
        print(f"{'ok' if ok else 'MISMATCH':8} backward {name} {str(dtype)[6:]} {m}x{n}", flush=True)
    return 1 if failures else 0


def gemm_available() -> bool:
    """Whether this device and toolchain build in-GEMM modules (Hopper, CUTLASS headers)."""
    return gemm_target_reason(cuda_target(torch.device("cuda", torch.cuda.current_device()))) is None


def run_gemm_calls(gemm_items: list) -> int:
    """Each kernel of each GEMM_CALLS module on its problem, under the rule against eager and the
    float64 truth (outputs and a training BatchNorm's statistics); the number of mismatches."""
    device = torch.device("cuda", torch.cuda.current_device())
    failures = 0
    for (name, dtype, m, n, k), (program, _, params) in zip(GEMM_CALLS, gemm_items):
        module = fxcuda.engine.prepare_gemm(program, dtype, params, device)
        x, w, b, values = draw(program, dtype, m, n, k, seed=0)
        eager = reference.op_forward(program, x, w, b, values, False)
        exact = truth(program, x, w, b, values)
        stats = truth_statistics(program, x, w, b, values) if program.batch_norm_training is not None else None
        for config in kernels(module) if module is not None else ():
            got = run_config_outputs(module, program, x, w, b, values, config)
            torch.cuda.synchronize()
            try:
                assert_under_rule(got[0], eager[0], exact)
                if stats is not None:  # a training BatchNorm's batch statistics
                    assert_under_rule(got[1], eager[1], stats.to(got[1].dtype))
                ok = True
            except AssertionError:
                ok = False
            failures += not ok
            print(f"{'ok' if ok else 'MISMATCH':8} in-GEMM {name} {str(dtype)[6:]} {m}x{k}x{n} "
                  f"{module.config_names[config]}", flush=True)
        if module is None:
            failures += 1
            print(f"MISMATCH in-GEMM {name}: no module ({fxcuda.engine.gemm_error(program, dtype, params, device)})")
    return failures


if __name__ == "__main__":
    sys.exit(main())
