#!/usr/bin/env bash
# One call on a GPU machine: install fxfuse, run the GPU tests, then the benchmark; logs in $OUT.
#   bash bench/device_run.sh [tests|bench|all] [pytest args...]
set -uo pipefail
what=${1:-all}; shift || true
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FXFUSE_CACHE_DIR=${FXFUSE_CACHE_DIR:-/tmp/fxfuse-cache}
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || { cat "$OUT/install.log"; exit 1; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } | tee "$OUT/env.txt"
# Build every module first, in parallel (a build per chain at compile time is sequential).
python3 tests/gpu/prebuild.py 2>&1 | grep -v "^fxfuse: building" | tee "$OUT/prebuild.log"
python3 bench/prebuild_suite.py 2>&1 | grep -v "^fxfuse: building" | tee -a "$OUT/prebuild.log"
export FXFUSE_SKIP_EMULATOR=1  # the host-emulator tests run in CPU CI
status=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  python3 -m pytest tests/gpu -q -rs "$@" 2>&1 | tee "$OUT/gpu_tests.log"; status=${PIPESTATUS[0]}
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 bench/bench.py --json "$OUT/bench.json" --png "$OUT/bench.png" 2>&1 | tee "$OUT/bench.log"
fi
exit "$status"
