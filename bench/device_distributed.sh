#!/usr/bin/env bash
# One call on a two-GPU machine: install fxfuse (and the CUTLASS headers from .whl/ if carried),
# the two-GPU tests (tests/gpu/test_distributed.py), then bench/train_ddp_bench.py; logs in $OUT.
#   DIST_TESTS=0 to skip the tests, DIST_TEST_K narrows them (pytest -k); BENCH_RUNS: ';'-separated train_ddp_bench.py flag sets ('' for none)
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FXFUSE_CACHE_DIR=${FXFUSE_CACHE_DIR:-/tmp/fxfuse-cache} FXFUSE_SKIP_EMULATOR=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"; } \
  | tee "$OUT/env.txt"
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
