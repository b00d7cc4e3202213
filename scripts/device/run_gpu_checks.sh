#!/usr/bin/env bash
# The GPU checks of issue 8 in one run (at most ~8 minutes) on a GPU machine that has PyTorch (CUDA)
# and nvcc but no network: builds with the cuda preset, runs the `gpu` tests, the cuBLAS GEMM floor
# (bench/bm_cublas_gemm), Collider's backward on TinyLlama-1.1B at T=2048 (bench/bm_collider_backward)
# and the paper-scale TinyLlama-1.1B backward / end-to-end points (experiments/paper/
# tab_backward_time.toml), writing everything to ONE folder of at most 8 files.
#   ./scripts/device/fetch_debs.sh            # first, on a machine with apt: fills .debs/ (toml++,
#                                             # nlohmann-json, GoogleTest, Google Benchmark)
#   ./scripts/device/run_gpu_checks.sh [DEST] # on the GPU machine; DEST default ${OUT:-results/gpu-check}
# Env: COLLIDER_PYTHON (default python3), COLLIDER_GPU_CHECK_BUDGET_S (default 470, build included),
# COLLIDER_BUILD_TIMEOUT_S (default 300). Exit 0 when every step passed, 1 when one failed or was
# skipped for time, 2 when there is no GPU. On your own GPU machine with the -dev packages of
# scripts/bootstrap.sh installed, no .debs/ is needed: run it as is (results/gpu-check/).
# NOTE: written in a session without a GPU; only `bash -n`, shellcheck and the no-GPU exit were
# checked there. The dependency step is the one of scripts/device/run_paper_scale.sh.
# DEST: run.log (steps + summary), build.log, ctest_gpu.log, bm_cublas_gemm.json, backward.jsonl,
# tab_backward_time.jsonl, tables.md, details.tar.gz (nvidia-smi, CTest JUnit XML, benchmark logs,
# bm_backward_gemm.json when time allowed, resolved manifest and sweep log, CMake summary).
# shellcheck disable=SC2317  # pack, tables and finish are called from the EXIT trap
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
ROOT=$(pwd)
T0=$(date +%s)
BUDGET=${COLLIDER_GPU_CHECK_BUDGET_S:-470}
BUILD_TIMEOUT=${COLLIDER_BUILD_TIMEOUT_S:-300}
RESERVE=25   # seconds kept for tables and packing
PY=${COLLIDER_PYTHON:-python3}
DEPS=${COLLIDER_DEPS_DIR:-/tmp/collider-deps}
DEST=${1:-${OUT:-$ROOT/results/gpu-check}}
mkdir -p "$DEST" || { echo "run_gpu_checks: cannot create $DEST" >&2; exit 1; }
DEST=$(cd "$DEST" && pwd)
WORK="$ROOT/out/gpu-check-work"
rm -rf "$WORK" && mkdir -p "$WORK/logs"
exec > >(tee -a "$DEST/run.log") 2>&1

elapsed() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(date +%s) + T0 )); }
say() { printf '[gpu-check %s +%ss] %s\n' "$(date +%H:%M:%S)" "$(elapsed)" "$*"; }
SUMMARY=()
FAILED=0
note() {  # note STEP STATUS SECONDS [DETAIL]
  SUMMARY+=("$(printf '%-36s %-8s %4ss  %s' "$1" "$2" "$3" "${4:-}")")
  [[ "$2" == ok ]] || FAILED=1
}

# step NAME CAP_S MIN_S LOGFILE CMD...: runs CMD with a timeout of min(CAP_S, time left - RESERVE),
# output to LOGFILE (and its tail to run.log); skipped when fewer than MIN_S seconds are left.
step() {
  local name=$1 cap=$2 min_s=$3 log=$4; shift 4
  local limit=$(( $(left) - RESERVE ))
  ((limit > cap)) && limit=$cap
  if ((limit < min_s)); then
    say "step '$name' skipped: ${limit} s left, it needs ${min_s} s"
    note "$name" skipped 0 "time"
    return 1
  fi
  say "step '$name' (at most ${limit} s) -> $(basename "$log")"
  local t rc dt
  t=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
  rc=$?
  dt=$(( $(date +%s) - t ))
  tail -n 6 "$log" | sed 's/^/    /'
  if ((rc == 0)); then
    note "$name" ok "$dt"
  elif ((rc == 124 || rc == 137)); then
    say "step '$name': stopped at its ${limit} s limit"
    note "$name" timeout "$dt"
  else
    say "step '$name': exit $rc (see $(basename "$log"))"
    note "$name" failed "$dt" "exit $rc"
  fi
  return $rc
}

pack() {
  cp -f "$WORK/nvidia-smi.txt" "$WORK/logs/" 2>/dev/null
  [[ -f build/CMakeCache.txt ]] && grep -E '^(COLLIDER_CUDA|CMAKE_CUDA_ARCHITECTURES|CMAKE_CUDA_COMPILER|CMAKE_CXX_COMPILER|Torch_DIR|tomlplusplus_DIR|nlohmann_json_DIR|GTest_DIR|benchmark_DIR):' \
    build/CMakeCache.txt >"$WORK/logs/cmake-found.txt" 2>/dev/null
  [[ -s "$WORK/paper/results.jsonl" ]] && cp -f "$WORK/paper/results.jsonl" "$DEST/tab_backward_time.jsonl"
  (cd "$WORK" && timeout 30 tar czf "$DEST/details.tar.gz" --exclude='results.jsonl' . 2>/dev/null) || true
}
tables() {
  local f="$WORK/paper/results.jsonl" md="$DEST/tables.md"
  [[ -s "$f" ]] || return 0
  : >"$md"
  for script in tab_backward_time tab_end_to_end; do
    if timeout 60 "$PY" "plots/$script.py" --results "$f" --out "$WORK/tables" >>"$WORK/logs/tables.log" 2>&1; then
      { echo "## $script (TinyLlama-1.1B, paper scale)"; echo; cat "$WORK/tables/$script.md"; echo; } >>"$md"
    else
      echo "## $script: the plot script failed (details.tar.gz: logs/tables.log)" >>"$md"
    fi
  done
}
finish() {
  local rc=$?
  trap - EXIT
  tables
  pack
  say "summary (budget ${BUDGET} s, used $(elapsed) s):"
  printf '    %s\n' "${SUMMARY[@]}"
  ((rc == 0)) && rc=$FAILED
  say "exit $rc; files in $DEST:"
  ls -la "$DEST"
  exit "$rc"
}
trap finish EXIT
trap 'say "interrupted"; exit 130' INT TERM

# ---- 0. the machine ------------------------------------------------------------------------------
say "budget ${BUDGET} s (build at most ${BUILD_TIMEOUT} s); results -> $DEST; work -> $WORK"
timeout 30 nvidia-smi >"$WORK/nvidia-smi.txt" 2>&1 || say "warning: nvidia-smi failed"
head -n 12 "$WORK/nvidia-smi.txt" | sed 's/^/    /'
{
  echo "nproc $(nproc); $(uname -srm)"
  (cd /tmp && timeout 30 "$PY" -c "import sys,torch;print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda, '| gpu', torch.cuda.is_available() and torch.cuda.get_device_name(0))")
  if command -v nvcc >/dev/null; then nvcc --version | tail -n 1; else echo "nvcc: not on PATH"; fi
  cmake --version | head -n 1; echo "ninja $(ninja --version)"; g++ --version | head -n 1
} 2>&1 | sed 's/^/    /'
if ! (cd /tmp && timeout 30 "$PY" -c "import torch,sys;sys.exit(0 if torch.cuda.is_available() else 1)") 2>/dev/null; then
  say "error: $PY's torch sees no CUDA GPU here; these checks need one (nothing was built)"
  note "gpu present" failed 0 "no CUDA device visible to torch"
  exit 2
fi

# ---- 1. dependencies from .debs/ (as scripts/device/run_paper_scale.sh) -------------------------
shopt -s nullglob
debs=("$ROOT"/.debs/*.deb)
if ((${#debs[@]} == 0)); then
  say "warning: no .deb files in $ROOT/.debs (scripts/device/fetch_debs.sh fills it); using installed packages"
else
  rm -rf "$DEPS" && mkdir -p "$DEPS"
  for f in "${debs[@]}"; do timeout 60 dpkg -x "$f" "$DEPS" || { say "error: dpkg -x $f failed"; exit 1; }; done
  say "unpacked ${#debs[@]} .deb files into $DEPS"
  for pkg in tomlplusplus nlohmann_json GTest benchmark; do export "${pkg}_ROOT=$DEPS/usr"; done
  export LD_LIBRARY_PATH="$DEPS/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
TORCH_PREFIX=$(cd /tmp && "$PY" -c "import torch;print(torch.utils.cmake_prefix_path)") || exit 1
export CMAKE_PREFIX_PATH="$DEPS/usr:$TORCH_PREFIX${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
if ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH="/usr/local/cuda/bin:$PATH"
  say "nvcc not on PATH; using /usr/local/cuda/bin/nvcc"
fi
PRESET=cuda
if ! command -v nvcc >/dev/null; then
  PRESET=cpu
  say "warning: no nvcc: preset cpu, so the fused gather kernel and bm_cublas_gemm are not built"
  note "cuda preset" failed 0 "no nvcc"
fi

# ---- 2. build --------------------------------------------------------------------------------------
COLLIDER_JOBS=$(nproc)
export COLLIDER_NO_APT=1 COLLIDER_PYTHON="$PY" COLLIDER_PRESET="$PRESET" COLLIDER_JOBS
TARGETS=(collider_cli bm_collider_backward bm_backward_gemm test_gpu_collider)
[[ $PRESET == cuda ]] && TARGETS+=(test_gpu_gather bm_cublas_gemm)
if ! step "build (preset $PRESET)" "$BUILD_TIMEOUT" 60 "$DEST/build.log" ./scripts/bootstrap.sh; then
  grep -E '^\[bootstrap\]|error' "$DEST/build.log" | head -n 20 | sed 's/^/    /'
  if [[ -f build/build.ninja ]]; then  # a broken target must not stop the checks of the others
    step "build (needed targets only)" 240 60 "$WORK/logs/build-targets.log" \
      cmake --build build -j "$(nproc)" --target "${TARGETS[@]}"
  fi
fi
[[ -x build/collider ]] || { say "error: no build/collider after the build; stopping"; exit 1; }

# ---- 3. gpu tests ----------------------------------------------------------------------------------
step "ctest -L gpu" 150 30 "$DEST/ctest_gpu.log" \
  ctest --test-dir build -L gpu --output-on-failure -j 2 --timeout 120 --output-junit "$WORK/logs/ctest_gpu.xml"

# ---- 4. cuBLAS floor (Figure 4 beside libtorch) ----------------------------------------------------
if [[ -x build/bench/bm_cublas_gemm ]]; then
  step "bm_cublas_gemm (brief)" 90 30 "$WORK/logs/bm_cublas_gemm.log" build/bench/bm_cublas_gemm \
    --benchmark_filter='ratio_permille:(0|100|400|700|900|990)/' --benchmark_min_time=0.02 \
    --benchmark_min_warmup_time=0.05 --benchmark_out_format=json --benchmark_out="$DEST/bm_cublas_gemm.json"
  [[ -s "$DEST/bm_cublas_gemm.json" ]] || note "bm_cublas_gemm JSON" failed 0 "none written (see its log)"
else
  note "bm_cublas_gemm (brief)" skipped 0 "not built"
fi

# ---- 5. paper-scale TinyLlama-1.1B backward / end-to-end points (the issue's must-show) -------
MANIFEST=experiments/paper/tab_backward_time.toml
if [[ -f "$MANIFEST" ]]; then
  mkdir -p "$WORK/paper"
  step "paper TinyLlama-1.1B T=2048" 240 60 "$WORK/paper/sweep.log" build/collider run "$MANIFEST" \
    --out "$WORK/paper" --resume --set axes.model=tinyllama-1.1b --set 'axes.seq_len=[1224, 2048]'
else
  note "paper TinyLlama-1.1B T=2048" skipped 0 "no $MANIFEST"
fi

# ---- 6. Collider's backward on TinyLlama-1.1B, T=2048 ----------------------------------------------
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
if ! step "bm_collider_backward B=4" 150 60 "$WORK/logs/bm_collider_backward.log" build/bench/bm_collider_backward \
       --device cuda --bf16 --models tinyllama-1.1b --seq 2048 --batch 4 --reps 5 --json "$DEST/backward.jsonl"; then
  # eager attention at B=4, T=2048 keeps ~4 x 22 x 32 x 2048^2 scores: retry once with B=2 on OOM
  if grep -qi 'out of memory' "$WORK/logs/bm_collider_backward.log"; then
    rm -f "$DEST/backward.jsonl"
    step "bm_collider_backward B=2" 120 60 "$WORK/logs/bm_collider_backward_b2.log" build/bench/bm_collider_backward \
      --device cuda --bf16 --models tinyllama-1.1b --seq 2048 --batch 2 --reps 5 --json "$DEST/backward.jsonl"
  fi
fi

# ---- 7. torch's GEMMs for the same figure, if time is left ------------------------------------------
if [[ -x build/bench/bm_backward_gemm ]]; then
  step "bm_backward_gemm TinyLlama (brief)" 90 60 "$WORK/logs/bm_backward_gemm.log" \
    env COLLIDER_BENCH_SCALE=paper build/bench/bm_backward_gemm --benchmark_filter='model:tinyllama-1.1b/.*method:(dense|reduced|reduced_gather)/ratio_permille:(0|100|400|700|900|990)/' \
    --benchmark_min_time=0.02 --benchmark_min_warmup_time=0.05 --benchmark_out_format=json \
    --benchmark_out="$WORK/logs/bm_backward_gemm.json"
fi
exit 0
