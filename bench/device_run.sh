#!/usr/bin/env bash
# One call on a GPU machine: install fxfuse, build every module, then the stages asked for; logs
# in $OUT.
#   bash bench/device_run.sh STAGES [bench args...]
# STAGES, comma-separated: prebuild (only the builds: every module the tests and the suite use,
# into the cache, which stays while the machine does; cold, 498 modules in about 11 minutes of a
# 64-core host, two calls of 600 s at most (BENCHMARKS.md section 45): run it alone, again when
# its call is cut off, since a build cut off resumes where it stopped, then the other stages),
# tests (tests/gpu, the suite tests in parallel shards, spread over the host's
# GPUs), profile (the epilogue breakdown and an ncu
# summary of each kernel; PROFILE_ARGS), bench (bench/bench.py; BENCH_PARTS times groups of rows
# in processes of their own and merges them), sanitize
# (compute-sanitizer over one run of each kernel template; SANITIZE_TOOLS picks the tools),
# gemmncu (ncu of the in-GEMM kernels of the rows whose targets are missed, against cuBLAS and the
# bare CUTLASS kernel; GEMMNCU_SPECS),
# gradients (every suite model's gradients and the training example on CUDA), train
# (bench/train_bench.py; TRAIN_ARGS), compile (bench/compile_time.py: cold and warm compiles),
# rowpass (bench/row_pass.py: the row pass alone against Inductor's kernels; ROWPASS_ARGS),
# timing (BENCHMARKS.md section 30's open questions, side by side on the host's GPUs: S01's models
# over one and four input sets and after sustained load, with clocks; softmax, LayerNorm and
# RMSNorm inside the GEMM against their row pass; whether launching the GEMM and the kernels after
# it as programmatic dependents closes the bare CUTLASS kernel's gap to cuBLAS in replay, at
# M = 1024 and at decode).
set -uo pipefail
stages=${1:-tests,profile,bench}; shift || true
source "$(dirname "$0")/device_setup.sh"
LOGS=$OUT/logs  # per-process logs, under $OUT so a call cut short by its limit still returns them
mkdir -p "$LOGS"
has() { [[ ",$stages," == *",$1,"* ]]; }
# Build every module first, in parallel (a build per chain at compile time is sequential): the
# tests' and every suite model's at every size and dtype the tests run (tests/gpu/prebuild.py
# --suite, one line a module as it ends), else the benchmark's suite modules (PREBUILD_ARGS:
# bench/prebuild_suite.py's flags; by default the suite's size, bench's --dtype).
bench_dtype=bf16; prev=
for arg in "$@"; do [ "$prev" = --dtype ] && bench_dtype=$arg; prev=$arg; done
suite_stages=0  # the stages that compile suite models (timing, compile and sanitize build their own)
for stage in bench profile gradients train; do has $stage && suite_stages=1; done
{ if has tests || has prebuild; then python3 tests/gpu/prebuild.py --suite
  elif [ "$suite_stages" = 1 ]; then python3 bench/prebuild_suite.py ${PREBUILD_ARGS:---sizes full --dtypes $bench_dtype}; fi; } 2>&1 \
  | tee "$OUT/prebuild.log" | grep --line-buffered -v "^fxfuse: building\|^prebuild: [0-9]"
status=0
sanitize_pid=
if has sanitize; then  # beside the tests: neither is timed
  ( python3 tests/gpu/sanitize.py --build-only; rc=0
    for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
      timeout 240 compute-sanitizer --tool "$tool" --error-exitcode 3 python3 tests/gpu/sanitize.py \
        >"$LOGS/sanitize_$tool.log" 2>&1 || rc=1
    done; exit $rc ) & sanitize_pid=$!
fi
if has tests; then
  # The kernel tests, and the suite-model tests in shards (each compiles many models; the GPU is
  # far from busy), all at once.
  # test_kernels_match_reference (most of test_cuda_kernels.py) in shards of its own: in one
  # process with the rest it ran past 420 s
  # The other files of tests/gpu in groups of their own (in one process they ran past 420 s, the
  # in-GEMM tests never reached); the CPU-side files run in CPU CI.
  # On a host of several GPUs the shards take them in turn; the two-GPU tests see them all.
  # (the kernel tests without the reference cases, and the operand and pooling tests, each ran
  # past 420 s beside the device-function and dropout tests: apart since, BENCHMARKS.md section 44)
  groups=("tests/gpu/test_cuda_kernels.py --deselect tests/gpu/test_cuda_kernels.py::test_kernels_match_reference"
          "tests/gpu/test_cuda_device_functions.py tests/gpu/test_dropout_cuda.py"
          "tests/gpu/test_gemm_group_norm.py tests/gpu/test_gemm_batch_norm.py"
          "tests/gpu/test_operands_cuda.py" "tests/gpu/test_pooling_cuda.py" "tests/gpu/test_graph_timing_cuda.py")
  gpus=$(nvidia-smi -L | wc -l) shard=0 pids=()
  next_gpu() { gpu=$((shard++ % gpus)); }  # in this shell, before the shard forks
  for i in "${!groups[@]}"; do
    next_gpu; CUDA_VISIBLE_DEVICES=$gpu timeout 420 python3 -m pytest ${groups[$i]} -q -rs --durations=15 -p no:cacheprovider \
      >"$LOGS/gpu_kernels_g$i.log" 2>&1 & pids+=($!)
  done
  # test_gemm_epilogue.py in two: its tests that compile models of their own build those modules
  # one after another (a minute or two each), beside the others
  own="compiled or grows or by_default"
  for k in "$own" "not ($own)"; do
    next_gpu; CUDA_VISIBLE_DEVICES=$gpu timeout 420 python3 -m pytest tests/gpu/test_gemm_epilogue.py -k "$k" -q -rs \
      --durations=15 -p no:cacheprovider >"$LOGS/gpu_kernels_epilogue_${#pids[@]}.log" 2>&1 & pids+=($!)
  done
  # the two-GPU tests (seven torchrun jobs, one after another: 404 s of 420 in section 44), in two
  # processes where the host has a pair of GPUs for each
  if [ "$gpus" -ge 4 ]; then
    CUDA_VISIBLE_DEVICES=0,1 timeout 420 python3 -m pytest tests/gpu/test_distributed.py -k "ddp and not sync" -q -rs \
      -p no:cacheprovider >"$LOGS/gpu_kernels_distributed_0.log" 2>&1 & pids+=($!)
    CUDA_VISIBLE_DEVICES=2,3 timeout 420 python3 -m pytest tests/gpu/test_distributed.py -k "not (ddp and not sync)" -q -rs \
      -p no:cacheprovider >"$LOGS/gpu_kernels_distributed_1.log" 2>&1 & pids+=($!)
  else
    timeout 420 python3 -m pytest tests/gpu/test_distributed.py -q -rs -p no:cacheprovider \
      >"$LOGS/gpu_kernels_distributed.log" 2>&1 & pids+=($!)
  fi
  kernel_shards=("float32" "bfloat16" "float16 and not bfloat16")
  for i in "${!kernel_shards[@]}"; do
    next_gpu; CUDA_VISIBLE_DEVICES=$gpu timeout 420 python3 -m pytest tests/gpu/test_cuda_kernels.py::test_kernels_match_reference -q -rs \
      -k "${kernel_shards[$i]}" -p no:cacheprovider >"$LOGS/gpu_kernels_$i.log" 2>&1 & pids+=($!)
  done
  # (the full-size rows apart from the other compiles of the suite: together they took 410 s of
  # 420 in section 44)
  shards=("small and bf16" "small and fp32" "small and fp16" "full_size"
          "not small and not full_size and not gradients and not autocast" "gradients" "autocast")
  for i in "${!shards[@]}"; do
    next_gpu; CUDA_VISIBLE_DEVICES=$gpu timeout 420 python3 -m pytest tests/gpu/test_suite_cuda.py -q -rs --durations=15 -k "${shards[$i]}" \
      -p no:cacheprovider >"$LOGS/gpu_suite_$i.log" 2>&1 & pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || status=1; done
  cat "$LOGS"/gpu_kernels*.log "$LOGS"/gpu_suite_*.log >"$OUT/gpu_tests.log"
  tail -n 3 "$LOGS"/gpu_kernels*.log "$LOGS"/gpu_suite_*.log
  grep -h "^FAILED\|^ERROR" "$OUT/gpu_tests.log" | head -40
fi
if [ -n "$sanitize_pid" ]; then
  wait "$sanitize_pid" || status=1
  for f in "$LOGS"/sanitize_*.log; do echo "== $f"; cat "$f"; done >"$OUT/sanitize.log"
  grep -h "^==\|ERROR SUMMARY\|MISMATCH" "$OUT/sanitize.log"
fi
if has profile; then
  # PROFILE_ARGS: bench/epilogue_breakdown.py's flags (--rows, --items)
  python3 bench/epilogue_breakdown.py ${PROFILE_ARGS:-} 2>&1 | tee "$OUT/breakdown.log"
  ncu --clock-control none --kernel-name regex:"apply_kernel|stats_kernel|combine_kernel" --section SpeedOfLight \
    --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis --section InstructionStats --csv --page details \
    python3 bench/epilogue_breakdown.py --once ${PROFILE_ARGS:-} >"$LOGS/ncu.csv" 2>"$LOGS/ncu.err"
  { grep "^call:" "$LOGS/ncu.csv"; python3 bench/ncu_summary.py "$LOGS/ncu.csv"; } | tee "$OUT/ncu_summary.txt"
fi
if has gemmncu; then
  # ncu of the in-GEMM kernels of the rows whose bare-GEMM targets are missed, beside cuBLAS's
  # F.linear and the bare CUTLASS kernel ("identity"): where each one's time over the GEMM goes.
  # --clock-control none, as in the profile stage: ncu's default locks the clocks, which are the
  # card's to keep (and the gap to cuBLAS lives in them). GEMMNCU_SPECS: space-separated
  # ROWS@M,N,K (bench/gemm_configs.py's programs). Each spec runs once without ncu first, which
  # builds its modules outside ncu.
  for spec in ${GEMMNCU_SPECS:-identity,S01,S02,S04,S05,S17@1024,8192,8192 identity,S08@32768,4096,1024}; do
    rows=${spec%@*} shape=${spec#*@} log=${spec//[,@]/_}  # (a file name with a comma does not come back)
    python3 bench/gemm_configs.py --rows "$rows" --shape "$shape" --profile >"$LOGS/gemm_ncu_build_$log.log" 2>&1 \
      || { status=1; tail -n 20 "$LOGS/gemm_ncu_build_$log.log"; continue; }
    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section WarpStateStats --section Occupancy \
      --section LaunchStats --section ComputeWorkloadAnalysis --section InstructionStats --csv --page details \
      python3 bench/gemm_configs.py --rows "$rows" --shape "$shape" --profile >"$LOGS/gemm_ncu_$log.csv" \
      2>"$LOGS/gemm_ncu_$log.err"
    # (each launch, then each path's kernels and time: ncu_summary.py pairs the launches with
    # gemm_configs.py's "profiled:" lines in the same file)
    { echo "== $rows at $shape"; python3 bench/ncu_summary.py "$LOGS/gemm_ncu_$log.csv" --flops "$shape"; } \
      | tee -a "$OUT/gemm_ncu_summary.txt"
  done
fi
if has gradients; then  # gradients of every suite model, and the training example, against eager
  timeout 420 python3 -m pytest tests/gpu/test_suite_cuda.py::test_gradients_on_cuda tests/test_training.py -q -rs \
    -k "not cpu" -p no:cacheprovider 2>&1 | tee "$OUT/gpu_gradients.log" | tail -n 15 || status=1
fi
if has train; then  # forward + backward timings (TRAIN_ARGS: bench/train_bench.py's flags)
  python3 bench/train_bench.py --json "$OUT/train.json" ${TRAIN_ARGS:-} 2>&1 | tee "$OUT/train.log"
fi
if has timing; then
  gpus=$(nvidia-smi -L | wc -l) runs=(
    "python3 bench/timing_order.py --row ${TIMING_ROW:-S01} --csv $OUT/timing_order.csv"
    "python3 bench/gemm_configs.py --rows S11,S20,S21 --shape 1024,8192,8192;4096,4096,4096"
    "python3 bench/gemm_configs.py --rows identity,S01,S05,S21 --kernels 256x128/2x1,256x128/2x1/pdl --shape 1024,8192,8192;16,8192,8192")
  for i in "${!runs[@]}"; do
    CUDA_VISIBLE_DEVICES=$((i % gpus)) timeout 540 ${runs[$i]} >"$OUT/timing_$i.log" 2>&1 &
    [ "$gpus" -gt 1 ] || wait  # one GPU: one at a time
  done
  wait
  tail -n 30 "$OUT"/timing_*.log
fi
if has rowpass; then  # the row pass alone (builds only row modules; Inductor compiles each chain)
  python3 bench/row_pass.py ${ROWPASS_ARGS:-} 2>&1 | tee "$OUT/row_pass.log" || status=1
fi
if has compile; then  # cold and warm compile of a four-chain model, fxfuse against Inductor
  python3 bench/compile_time.py --json "$OUT/compile_time.json" 2>&1 | tee "$OUT/compile_time.log"
fi
if has bench; then
  if [ -n "${BENCH_PARTS:-}" ]; then
    # BENCH_PARTS: space-separated groups of rows ("S01,S02 S26"), each timed by a process of its
    # own under BENCH_PART_TIMEOUT seconds (a part cut short loses only its rows), then merged;
    # no part starts after BENCH_DEADLINE seconds of the stage (the command's own limit would
    # lose the merge too: a row of the suite takes 45-140 s). On a host of several GPUs the parts
    # take the GPUs in turn, one process a GPU at a time (each row's ratios come from its own card;
    # the processes share the host's CPUs, which the pipelined and latency columns feel).
    read -ra all_parts <<<"$BENCH_PARTS"
    gpus=$(nvidia-smi -L | wc -l) bench_start=$SECONDS
    for ((g = 0; g < gpus; g++)); do
      ( for ((j = g; j < ${#all_parts[@]}; j += gpus)); do
          part=${all_parts[$j]}
          if [ $((SECONDS - bench_start)) -ge "${BENCH_DEADLINE:-100000}" ]; then
            echo "not timed (BENCH_DEADLINE): $part" >"$LOGS/bench_$part.log"; continue
          fi
          CUDA_VISIBLE_DEVICES=$g timeout "${BENCH_PART_TIMEOUT:-400}" python3 bench/bench.py --rows "$part" \
            --json "$LOGS/bench_$part.json" "$@" >"$LOGS/bench_$part.log" 2>&1 || touch "$LOGS/bench_failed"
        done ) &
    done
    wait
    cat "$LOGS"/bench_*.log >>"$OUT/bench.log"
    [ -e "$LOGS/bench_failed" ] && status=1
    parts=("$LOGS"/bench_*.json)
    [ -e "${parts[0]}" ] && python3 bench/bench.py --merge "${parts[@]}" --json "$OUT/bench.json" | tee -a "$OUT/bench.log"
  else
    python3 bench/bench.py --json "$OUT/bench.json" --png "$OUT/bench.png" "$@" 2>&1 | tee "$OUT/bench.log"
  fi
  [ -f "$OUT/bench.json" ] && python3 bench/targets.py "$OUT/bench.json" | tee -a "$OUT/bench.log"
fi
exit "$status"
