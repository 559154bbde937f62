#!/usr/bin/env bash
# One call on a Hopper GPU machine for the in-GEMM back end: install fxfuse and the CUTLASS headers
# (wheels placed in .whl/ for a machine without network), the in-GEMM tests (GEMM_TESTS, empty: none),
# then the benchmark of the rows given (BENCH_ROWS).
set -uo pipefail
source "$(dirname "$0")/device_setup.sh"
status=0
GEMM_TESTS=${GEMM_TESTS-tests/gpu/test_gemm_epilogue.py}
if [ -n "$GEMM_TESTS" ]; then
  timeout ${TEST_TIMEOUT:-480} python3 -m pytest $GEMM_TESTS -q -rs -x \
    -p no:cacheprovider 2>&1 | tee "$OUT/gemm_tests.log" | tail -n 30 || status=1
fi
if [ -n "${BENCH_ROWS:-}" ]; then
  python3 bench/bench.py --rows "$BENCH_ROWS" --dtype "${BENCH_DTYPE:-bf16}" --json "$OUT/bench.json" \
    ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -n 40
fi
exit "$status"
