#!/usr/bin/env bash
# Builds Collider on a GPU machine that has PyTorch but no network, then runs the paper-scale
# backward / end-to-end points (experiments/paper/tab_backward_time.toml; the same rows give
# tab_end_to_end), TinyLlama-1.1B first, within a fixed time budget, writing everything to ONE
# folder of at most 8 flat files (what the lab's device tool brings back from $OUT).
#   ./scripts/device/fetch_debs.sh                  # first, on a machine with apt: fills .debs/
#   ./scripts/device/run_paper_scale.sh [DEST]      # on the GPU machine; DEST default $OUT, else
#                                                   # results/paper-run
# Needs there: python3 with torch (CUDA) and matplotlib, nvcc, cmake, ninja, g++; the .deb files
# in .debs/ (toml++, nlohmann-json, GoogleTest, Google Benchmark) are unpacked with dpkg -x into
# /tmp/collider-deps (never into /). Env: COLLIDER_DEVICE_BUDGET_S (default 500 s, build
# included), COLLIDER_BUILD_TIMEOUT_S (default 330). Re-running continues the sweeps (--resume;
# work folder out/paper-run-work/). Give the whole command ~600 s.
# Steps, in order of priority (each skipped when time is short):
#   1 TinyLlama-1.1B T=2048 (+T' floor 1224), eager   2 the same with attention_impl=sdpa
#   3 Qwen2.5-1.5B, Phi-1.5 T=2048 (+floor)            4 all three at T=1024 (+floor 608)
#   5 Figure 4 micro-benchmark, TinyLlama projections (if >= 150 s remain)
# Check of the dependency path on any machine (no GPU, nothing run): configures BUILD_DIR (preset
# cuda) against the unpacked .debs with /usr hidden from find_package, and checks where each
# package was found:   ./scripts/device/run_paper_scale.sh --check-deps /tmp/build-depcheck
# DEST: run.log, build.log, nvidia-smi.txt, tab_backward_time.jsonl (eager rows),
# tab_backward_time_sdpa.jsonl, tables.md (backward + end-to-end tables), bm_backward_gemm.json,
# details.tar.gz (resolved manifests, env.json, sweep logs, LaTeX tables, CMake summary).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
ROOT=$(pwd)
T0=$(date +%s)
BUDGET=${COLLIDER_DEVICE_BUDGET_S:-500}
BUILD_TIMEOUT=${COLLIDER_BUILD_TIMEOUT_S:-330}
RESERVE=40   # seconds kept at the end for tables and packing

CHECK_DEPS=""
if [[ "${1:-}" == --check-deps ]]; then
  CHECK_DEPS=${2:?--check-deps needs a build directory}
  CHECK_DEPS=$(mkdir -p "$CHECK_DEPS" && cd "$CHECK_DEPS" && pwd)
  set -- "$CHECK_DEPS/dest"
fi
DEST=${1:-${OUT:-$ROOT/results/paper-run}}
mkdir -p "$DEST" || { echo "run_paper_scale: cannot create $DEST" >&2; exit 1; }
DEST=$(cd "$DEST" && pwd)
WORK="$ROOT/out/paper-run-work"
PY=${COLLIDER_PYTHON:-python3}
DEPS=${COLLIDER_DEPS_DIR:-/tmp/collider-deps}
mkdir -p "$WORK"
exec > >(tee -a "$DEST/run.log") 2>&1

elapsed() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(date +%s) + T0 )); }
say() { printf '[paper-run %s +%ss] %s\n' "$(date +%H:%M:%S)" "$(elapsed)" "$*"; }

# ---- packing DEST (after every step and on exit, so that a kill still leaves results) ----------
pack() {
  for name in tab_backward_time tab_backward_time_sdpa; do
    [[ -s "$WORK/$name/results.jsonl" ]] && cp -f "$WORK/$name/results.jsonl" "$DEST/$name.jsonl"
  done
  [[ -s "$WORK/bench/bm_backward_gemm.json" ]] && cp -f "$WORK/bench/bm_backward_gemm.json" "$DEST/"
  (cd "$WORK" && timeout 30 tar czf "$DEST/details.tar.gz" --exclude='*.jsonl' --exclude='bm_backward_gemm.json' \
     . 2>/dev/null) || true
}
tables() {  # backward and end-to-end tables of every results file, into DEST/tables.md
  local md="$DEST/tables.md"
  : >"$md"
  for name in tab_backward_time tab_backward_time_sdpa; do
    local f="$WORK/$name/results.jsonl"
    [[ -s "$f" ]] || continue
    mkdir -p "$WORK/tables-$name"
    for script in tab_backward_time tab_end_to_end; do
      if timeout 60 "$PY" plots/$script.py --results "$f" --out "$WORK/tables-$name" >>"$WORK/tables.log" 2>&1; then
        { echo "## $script from $name.jsonl"; echo; cat "$WORK/tables-$name/$script.md"; echo; } >>"$md"
      else
        echo "## $script from $name.jsonl: plot script failed (see details.tar.gz: tables.log)" >>"$md"
      fi
    done
  done
}
finish() {
  local rc=$?
  trap - EXIT
  say "packing results into $DEST"
  tables
  pack
  say "finished with exit code $rc after $(elapsed) s; files in $DEST:"
  ls -la "$DEST"
  exit $rc
}
trap finish EXIT
trap 'say "interrupted"; exit 130' INT TERM

# ---- 0. the machine -----------------------------------------------------------------------------
if [[ -n "$CHECK_DEPS" ]]; then
  trap - EXIT
  say "--check-deps: dependency path only, configure into $CHECK_DEPS (no GPU needed, nothing is run)"
else
say "budget ${BUDGET} s (build at most ${BUILD_TIMEOUT} s); results -> $DEST; work -> $WORK"
timeout 30 nvidia-smi >"$DEST/nvidia-smi.txt" 2>&1 || say "warning: nvidia-smi failed (see nvidia-smi.txt)"
timeout 30 nvidia-smi -L 2>&1 | head -4
{
  echo "nproc $(nproc); $(uname -srm)"
  timeout 20 "$PY" -c "import sys,torch;print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda, '| gpu', torch.cuda.is_available() and torch.cuda.get_device_name(0))" 2>&1
  command -v nvcc >/dev/null && nvcc --version | tail -1
  cmake --version | head -1; ninja --version | sed 's/^/ninja /'; g++ --version | head -1
} 2>&1 | sed 's/^/    /'
if ! timeout 30 "$PY" -c "import torch,sys;sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  say "error: $PY's torch sees no CUDA GPU here; this script is for the GPU machine"
  exit 2
fi
fi

# ---- 1. dependencies from .debs/ ----------------------------------------------------------------
shopt -s nullglob
debs=("$ROOT"/.debs/*.deb)
if ((${#debs[@]} == 0)); then
  say "error: no .deb files in $ROOT/.debs; run scripts/device/fetch_debs.sh on a machine with apt and"
  say "       bring .debs along (the lab's device tool: carry [\".debs\"])"
  exit 1
fi
rm -rf "$DEPS" && mkdir -p "$DEPS"
unpack_deb() {  # dpkg -x, or ar + tar where dpkg is missing
  if command -v dpkg >/dev/null; then
    timeout 60 dpkg -x "$1" "$DEPS"
    return
  fi
  local member
  member=$(ar t "$1" | grep '^data\.tar') || return 1
  ar p "$1" "$member" | case "$member" in
    *.xz) xz -dc ;; *.zst) zstd -dc ;; *.gz) gzip -dc ;; *) cat ;;
  esac | tar -x -C "$DEPS" -f -
}
for f in "${debs[@]}"; do unpack_deb "$f" || { say "error: unpacking $f failed"; exit 1; }; done
say "unpacked ${#debs[@]} .deb files into $DEPS"
# Debian's CMake package files compute their prefix from their own location (relocatable); the
# prefix path and the <Pkg>_ROOT hints point find_package at them, ahead of any system copy.
export CMAKE_PREFIX_PATH="$DEPS/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
for pkg in tomlplusplus nlohmann_json GTest benchmark; do export "${pkg}_ROOT=$DEPS/usr"; done
export LD_LIBRARY_PATH="$DEPS/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
for cfg in lib/x86_64-linux-gnu/cmake/tomlplusplus/tomlplusplusConfig.cmake share/cmake/nlohmann_json/nlohmann_jsonConfig.cmake \
           lib/x86_64-linux-gnu/cmake/GTest/GTestConfig.cmake lib/x86_64-linux-gnu/cmake/benchmark/benchmarkConfig.cmake; do
  [[ -f "$DEPS/usr/$cfg" ]] || { say "error: $DEPS/usr/$cfg missing after unpacking; re-run fetch_debs.sh"; exit 1; }
done
if ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH="/usr/local/cuda/bin:$PATH"
  say "nvcc not on PATH; using /usr/local/cuda/bin/nvcc"
fi

if [[ -n "$CHECK_DEPS" ]]; then
  # The configure step of scripts/bootstrap.sh, with every system prefix hidden from find_package
  # (/usr and /usr/local: where a machine with the -dev packages installed has them).
  torch_prefix=$(cd /tmp && "$PY" -c "import torch;print(torch.utils.cmake_prefix_path)") || exit 1
  cmake --preset cuda -B "$CHECK_DEPS" -DCMAKE_PREFIX_PATH="$torch_prefix" -DPython3_EXECUTABLE="$PY" \
    "-DCMAKE_IGNORE_PREFIX_PATH=/usr;/usr/local;/" -Wno-dev >"$CHECK_DEPS/configure.log" 2>&1
  rc=$?
  grep -E 'collider:|Found|CMake Error' "$CHECK_DEPS/configure.log" | sed 's/^/    /'
  ((rc == 0)) || { say "configure FAILED (exit $rc); see $CHECK_DEPS/configure.log"; tail -20 "$CHECK_DEPS/configure.log"; exit 1; }
  bad=0
  for pkg in tomlplusplus nlohmann_json GTest benchmark; do
    dir=$(sed -n "s/^${pkg}_DIR:PATH=//p" "$CHECK_DEPS/CMakeCache.txt")
    if [[ "$dir" == "$DEPS"/* ]]; then say "  $pkg: $dir (from the .debs)"; else say "  $pkg: '$dir' NOT from $DEPS"; bad=1; fi
  done
  ((bad == 0)) && say "dependency check passed" || say "dependency check FAILED"
  exit $bad
fi

# ---- 2. build -----------------------------------------------------------------------------------
build_limit=$(( $(left) - RESERVE - 60 ))
((build_limit > BUILD_TIMEOUT)) && build_limit=$BUILD_TIMEOUT
if ((build_limit < 60)); then say "error: only $(left) s left before the build"; exit 1; fi
say "building (scripts/bootstrap.sh, preset cuda, $(nproc) jobs, at most ${build_limit} s) -> build.log"
t_b=$(date +%s)
COLLIDER_NO_APT=1 COLLIDER_PYTHON="$PY" COLLIDER_PRESET=cuda COLLIDER_JOBS=$(nproc) \
  timeout --kill-after=10 "$build_limit" ./scripts/bootstrap.sh >"$DEST/build.log" 2>&1
rc=$?
grep -E '^\[bootstrap\]|collider:' "$DEST/build.log" | sed 's/^/    /' | head -20
if ((rc != 0 && rc != 124 && rc != 137)) && [[ -f build/build.ninja ]]; then
  # A target this run does not need (a test, say) may have broken the full build: build only the
  # CLI and the micro-benchmark, and go on if they link.
  say "warning: the full build failed (exit $rc); building only collider_cli and bm_backward_gemm"
  grep -E 'error|FAILED' "$DEST/build.log" | head -10 | sed 's/^/    /'
  limit=$(( $(left) - RESERVE - 60 ))
  if ((limit >= 30)); then
    timeout --kill-after=10 "$limit" cmake --build build -j "$(nproc)" --target collider_cli bm_backward_gemm \
      >>"$DEST/build.log" 2>&1 && rc=0
  fi
fi
if ((rc != 0)) || [[ ! -x build/collider ]]; then
  ((rc == 124)) && say "error: the build ran out of its ${build_limit} s" || say "error: the build failed (exit $rc)"
  grep -E 'error|Error|CMake Error' "$DEST/build.log" | head -20 | sed 's/^/    /'
  tail -15 "$DEST/build.log" | sed 's/^/    /'
  exit 1
fi
say "built in $(( $(date +%s) - t_b )) s"
mkdir -p "$WORK/build-info"
grep -E '^(tomlplusplus_DIR|nlohmann_json_DIR|GTest_DIR|benchmark_DIR|Torch_DIR|CMAKE_CUDA_COMPILER|CMAKE_CXX_COMPILER|CMAKE_CUDA_ARCHITECTURES):' build/CMakeCache.txt \
  >"$WORK/build-info/cmake-found.txt" 2>/dev/null
sed 's/^/    /' "$WORK/build-info/cmake-found.txt"
timeout 60 build/collider models >"$WORK/build-info/models.txt" 2>&1 || say "warning: collider models failed"

# ---- 3. the sweeps, in order of priority --------------------------------------------------------
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
FAILED=0
STEP=0
MANIFEST=experiments/paper/tab_backward_time.toml
sweep() {  # sweep LABEL OUTNAME MIN_SECONDS --set ... : one slice of the manifest, resumable
  local label=$1 outname=$2 min_s=$3; shift 3
  local limit=$(( $(left) - RESERVE ))
  if ((limit < min_s)); then
    say "step '$label' skipped: ${limit} s left, it needs about ${min_s} s"
    FAILED=1
    return
  fi
  mkdir -p "$WORK/$outname"
  say "step '$label' (at most ${limit} s) -> $outname"
  timeout --kill-after=15 "$limit" build/collider run "$MANIFEST" --out "$WORK/$outname" --resume "$@" \
    2>&1 | tee -a "$WORK/$outname/sweep.log"
  local rc=${PIPESTATUS[0]}
  STEP=$((STEP + 1))
  cp -f "$WORK/$outname/manifest.resolved.toml" "$WORK/$outname/manifest.resolved.step$STEP.toml" 2>/dev/null
  if ((rc == 124 || rc == 137)); then
    say "step '$label': stopped at its time limit (complete rows are kept)"
  elif ((rc != 0)); then
    say "step '$label': exit $rc (some points failed; their rows say why)"
  fi
  ((rc != 0)) && FAILED=1
  pack
}
T2048=(--set 'axes.seq_len=[1224, 2048]')
sweep "TinyLlama-1.1B T=2048 eager" tab_backward_time 60 --set axes.model=tinyllama-1.1b "${T2048[@]}"
sweep "TinyLlama-1.1B T=2048 sdpa" tab_backward_time_sdpa 60 --set axes.model=tinyllama-1.1b "${T2048[@]}" \
  --set run.attention_impl=sdpa
sweep "Qwen2.5-1.5B, Phi-1.5 T=2048 eager" tab_backward_time 60 \
  --set 'axes.model=["qwen2.5-1.5b", "phi-1.5"]' "${T2048[@]}"
sweep "all three T=1024 eager" tab_backward_time 60 --set 'axes.seq_len=[608, 1024]'

# ---- 4. the Figure 4 micro-benchmark, if time is left -------------------------------------------
limit=$(( $(left) - RESERVE ))
if ((limit >= 150)) && [[ -x build/bench/bm_backward_gemm ]]; then
  mkdir -p "$WORK/bench"
  say "Figure 4 micro-benchmark, TinyLlama projections, paper scale (at most ${limit} s)"
  COLLIDER_BENCH_SCALE=paper timeout --kill-after=10 "$limit" build/bench/bm_backward_gemm \
    --benchmark_filter='model:tinyllama-1.1b/.*ratio_permille:(0|100|300|400|500|700|900|950|990)/' \
    --benchmark_min_time=0.05 --benchmark_out_format=json --benchmark_out="$WORK/bench/bm_backward_gemm.json" \
    >"$WORK/bench/bench.log" 2>&1 || { say "micro-benchmark: exit $? (see details.tar.gz: bench/bench.log)"; FAILED=1; }
  tail -2 "$WORK/bench/bench.log" | sed 's/^/    /'
else
  say "micro-benchmark skipped (${limit} s left; it needs 150 s)"
fi
exit $FAILED
