# Sourced by the bench/device_*.sh scripts, in the repository root on a GPU machine: $OUT, the
# environment every run uses, the CUTLASS headers (wheels carried in .whl/, for a machine without
# network) on PYTHONPATH, fxfuse installed (editable), and the device and torch versions in
# $OUT/env.txt. Exits the calling script if fxfuse does not install.
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FXFUSE_CACHE_DIR=${FXFUSE_CACHE_DIR:-/tmp/fxfuse-cache}
export FXFUSE_SKIP_EMULATOR=1  # the host-emulator tests run in CPU CI
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"; } \
  | tee "$OUT/env.txt"
