#!/usr/bin/env bash
# One call on a GPU machine: install fxfuse (and the CUTLASS headers from .whl/ if carried), then the
# GPU tests named in VERIFY_TESTS (pytest node ids or files; default: the kernel tests, the operand
# and second-output tests, the suite rows at full size and the new rows), in parallel shards of
# VERIFY_SHARDS ('|'-separated -k expressions for tests/gpu/test_suite_cuda.py); logs in $OUT.
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
LOGS=$(mktemp -d)
export PYTHONUNBUFFERED=1 FXFUSE_CACHE_DIR=${FXFUSE_CACHE_DIR:-/tmp/fxfuse-cache} FXFUSE_SKIP_EMULATOR=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } | tee "$OUT/env.txt"
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
