#!/usr/bin/env bash
# One call on a two-GPU machine: install fxfuse (and the CUTLASS headers from .whl/ if carried),
# the two-GPU tests (tests/gpu/test_distributed.py), then bench/train_ddp_bench.py; logs in $OUT.
#   DIST_TESTS=0 to skip the tests, DIST_TEST_K narrows them (pytest -k); BENCH_RUNS: ';'-separated train_ddp_bench.py flag sets ('' for none)
set -uo pipefail
source "$(dirname "$0")/device_setup.sh"
status=0
if [ "${DIST_TESTS:-1}" = 1 ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest tests/gpu/test_distributed.py -q -rs -x -p no:cacheprovider ${DIST_TEST_K:+-k "$DIST_TEST_K"} \
    2>&1 | tee "$OUT/distributed_tests.log" | tail -n 40 || status=1
fi
IFS=';' read -ra runs <<<"${BENCH_RUNS-}"
for i in "${!runs[@]}"; do
  timeout ${BENCH_TIMEOUT:-300} python3 -m torch.distributed.run --standalone --nproc-per-node=2 bench/train_ddp_bench.py \
    ${runs[$i]} --json "$OUT/train_ddp_$i.json" 2>&1 | grep -v "^\[rank.\]:W\|^W1\|Profiler" | tee "$OUT/train_ddp_$i.log" | tail -n 30
done
exit "$status"
