#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/: safetensors reader, manifest loaders with --set, token
# shards and reference-loss files, Plan::from_string) with clang, ASan and UBSan into build-fuzz/,
# and runs them side by side, each for a bounded time, from its committed seed corpus (fuzz/seeds/<name>/) plus what
# earlier runs found (build-fuzz/corpus/<name>/). Exits 1 when any target crashes, leaks past the
# sanitizers or times out on an input; the input is kept in build-fuzz/findings/<name>/ (make it a
# regression test: tests/fuzz_regressions/ + tests/test_fuzz_regressions.cpp). Run by ./scripts/test.sh.
#   ./scripts/fuzz.sh                          # every target, COLLIDER_FUZZ_SECONDS (default 25) each
#   ./scripts/fuzz.sh fuzz_plan                # one target
#   COLLIDER_FUZZ_SECONDS=600 ./scripts/fuzz.sh fuzz_manifest
# Each run's figures (executions, coverage, corpus, crashes) go to build-fuzz/summary.tsv too.
# COLLIDER_JOBS: build parallelism (default: number of cores); COLLIDER_FUZZ_JOBS: targets fuzzed at once
# (default: the cores; each libFuzzer process is single-threaded).
# Needs clang and libclang-rt-14-dev (scripts/bootstrap.sh installs them) and the Python env with torch.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
SECS=${COLLIDER_FUZZ_SECONDS:-25}
TARGETS=(fuzz_safetensors fuzz_manifest fuzz_tokens fuzz_plan)
(($#)) && TARGETS=("$@")
say() { echo "[fuzz] $*"; }

CXX=${COLLIDER_FUZZ_CXX:-clang++}
CC=${COLLIDER_FUZZ_CC:-clang}
if ! command -v "$CXX" >/dev/null; then
  say "error: $CXX not found; run ./scripts/bootstrap.sh (it installs clang and libclang-rt-14-dev)" >&2
  exit 2
fi
# PY, TORCH_PREFIX, LAUNCHER (ccache), shared with scripts/test.sh --asan.
source scripts/clang_env.sh
start=$(date +%s)
# The cores (nproc honours OMP_NUM_THREADS, which scripts/test.sh sets to 1 for the tests).
CORES=${COLLIDER_JOBS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}
# The library (libtorch aside) is compiled instrumented (COLLIDER_FUZZ in CMakeLists.txt); no
# tests, benchmarks or data-parallel code in this tree.
cmake -S . -B build-fuzz -G Ninja -DCOLLIDER_FUZZ=ON -DCMAKE_CXX_COMPILER="$CXX" -DCMAKE_C_COMPILER="$CC" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCOLLIDER_BUILD_TESTS=OFF -DCOLLIDER_BUILD_BENCH=OFF -DCOLLIDER_DISTRIBUTED=OFF \
  -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" -DPython3_EXECUTABLE="$PY" "${LAUNCHER[@]}" -Wno-dev \
  >build-fuzz.configure.log 2>&1 || { cat build-fuzz.configure.log; exit 1; }
rm -f build-fuzz.configure.log
cmake --build build-fuzz -j "$CORES" --target "${TARGETS[@]}"
say "built in $(( $(date +%s) - start )) s"

# libtorch is not instrumented and keeps process-lifetime allocations (thread pools, caches) that
# LeakSanitizer reports at exit: leak detection off. Every other ASan/UBSan finding aborts.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=1:symbolize=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export OMP_NUM_THREADS=1
failed=()
summary=()
tsv=build-fuzz/summary.tsv
printf 'target\tseconds\texecutions\tcov\tft\tcorpus_in_memory\tcorpus_files\tseeds\tcrashes\texit\n' >"$tsv"
# The targets run side by side, COLLIDER_FUZZ_JOBS at a time (default: the number of cores; each
# libFuzzer process is single-threaded), each for SECS seconds; their logs are read afterwards.
JOBS=${COLLIDER_FUZZ_JOBS:-$CORES}
run_target() {  # $1 target; writes build-fuzz/$1.log and build-fuzz/$1.rc
  local t=$1 seeds=fuzz/seeds/${1#fuzz_} dict=() rc=0
  [[ -f fuzz/${t#fuzz_}.dict ]] && dict=(-dict="fuzz/${t#fuzz_}.dict")
  "build-fuzz/fuzz/$t" "build-fuzz/corpus/$t" "$seeds" "${dict[@]}" -max_total_time="$SECS" -timeout=10 \
    -rss_limit_mb=3072 -print_final_stats=1 -artifact_prefix="build-fuzz/findings/$t/" >"build-fuzz/$t.log" 2>&1 || rc=$?
  echo "$rc" >"build-fuzz/$t.rc"
}
running=0
for t in "${TARGETS[@]}"; do
  rm -f "build-fuzz/$t.rc"
  rm -rf "build-fuzz/findings/$t"  # this run's findings only (copy one to tests/fuzz_regressions/ to keep it)
  mkdir -p "build-fuzz/corpus/$t" "build-fuzz/findings/$t"
  say "$t: ${SECS} s from fuzz/seeds/${t#fuzz_} (+ build-fuzz/corpus/$t)"
  run_target "$t" &
  running=$((running + 1))
  if ((running >= JOBS)); then
    wait -n || true
    running=$((running - 1))
  fi
done
wait || true
for t in "${TARGETS[@]}"; do
  seeds=fuzz/seeds/${t#fuzz_}
  corpus=build-fuzz/corpus/$t
  findings=build-fuzz/findings/$t
  log=build-fuzz/$t.log
  rc=$(cat "build-fuzz/$t.rc" 2>/dev/null || echo 1)
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | tail -1 | grep -o '[0-9]*$' || echo 0)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | grep -o '[0-9]*' || echo 0)
  ft=$(grep -o 'ft: [0-9]*' "$log" | tail -1 | grep -o '[0-9]*' || echo 0)
  n_corpus=$(find "$corpus" -type f | wc -l)
  n_seeds=$(find "$seeds" -type f | wc -l)
  # libFuzzer's last status line ("#N DONE cov: C ft: F corp: K/SIZE ..."): inputs in its corpus.
  corp=$(grep -o 'corp: [0-9]*' "$log" | tail -1 | grep -o '[0-9]*' || echo 0)
  n_crashes=$(find "$findings" -type f | wc -l)
  line="$t: ${execs} executions in ${SECS} s, cov ${cov} edges, ft ${ft} features, corpus ${n_corpus} inputs"
  if ((rc != 0)); then
    line+=", FAILED (exit $rc): $(find "$findings" -type f -printf '%f ')"
    failed+=("$t")
    grep -E "ERROR:|SUMMARY:|runtime error|terminate called|what\(\)" "$log" | head -5 | sed 's/^/    /' >&2 || true
    say "  replay: build-fuzz/fuzz/$t $findings/<file>   (full log: $log)" >&2
  fi
  summary+=("$line")
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$t" "$SECS" "$execs" "$cov" "$ft" "$corp" "$n_corpus" \
    "$n_seeds" "$n_crashes" "$rc" >>"$tsv"
  say "$line"
done
say "summary (clang $("$CXX" --version | head -1 | grep -o '[0-9][0-9.]*' | head -1), $(getconf _NPROCESSORS_ONLN) cores):"
for l in "${summary[@]}"; do say "  $l"; done
if ((${#failed[@]})); then
  say "FAILED: ${failed[*]}" >&2
  exit 1
fi
