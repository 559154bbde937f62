#!/usr/bin/env bash
# One call on a GPU machine: install fxfuse (and the CUTLASS headers from .whl/ if carried), then the
# GPU tests named in VERIFY_TESTS (pytest node ids or files; default: the kernel tests, the operand
# and second-output tests, the suite rows at full size and the new rows), in parallel shards of
# VERIFY_SHARDS ('|'-separated -k expressions for tests/gpu/test_suite_cuda.py); logs in $OUT.
set -uo pipefail
LOGS=$(mktemp -d)
source "$(dirname "$0")/device_setup.sh"
TESTS=${VERIFY_TESTS-tests/gpu/test_operands_cuda.py tests/gpu/test_cuda_kernels.py tests/gpu/test_gemm_group_norm.py}
SHARDS=${VERIFY_SHARDS-full_size|S26 or S27|small and bf16 and not S26 and not S27}
status=0 pids=()
if [ -n "$TESTS" ]; then
  timeout ${VERIFY_TIMEOUT:-500} python3 -m pytest $TESTS -q -rs -p no:cacheprovider >"$LOGS/tests.log" 2>&1 & pids+=($!)
fi
IFS='|' read -ra shards <<<"$SHARDS"
for i in "${!shards[@]}"; do
  timeout ${VERIFY_TIMEOUT:-500} python3 -m pytest tests/gpu/test_suite_cuda.py -q -rs -k "${shards[$i]}" \
    -p no:cacheprovider >"$LOGS/suite_$i.log" 2>&1 & pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || status=1; done
cat "$LOGS"/*.log >"$OUT/verify.log"
tail -n 3 "$LOGS"/*.log
grep -h "^FAILED\|^ERROR" "$OUT/verify.log" | head -40
exit "$status"
