#!/usr/bin/env bash
# One GPU call for the in-GEMM group norm: its tests, then every path of the suite's group-norm rows
# (bench/gemm_configs.py) at their sizes.
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export FXFUSE_CACHE_DIR=${FXFUSE_CACHE_DIR:-/tmp/fxfuse-cache}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
GEMM_TESTS=${GEMM_TESTS-tests/gpu/test_gemm_group_norm.py} bash bench/device_gemm.sh
status=$?
timeout 150 python3 bench/gemm_configs.py --rows S02,S04,S17 --repeats 10 2>&1 | tee "$OUT/configs_group.txt" | tail -n 4
timeout 100 python3 bench/gemm_configs.py --rows S08 --shape 32768,4096,1024 --repeats 10 2>&1 | tee -a "$OUT/configs_group.txt" | tail -n 2
exit $status
