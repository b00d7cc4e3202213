#!/usr/bin/env bash
# Sets up (scripts/bootstrap.sh), builds, runs every C++ test with CTest, then the Python package's
# tests with pytest (python/tests, on this checkout's build/python), then the libFuzzer targets for
# a bounded time each (scripts/fuzz.sh: clang + ASan + UBSan build in build-fuzz/). A failure in any
# step fails the command; every step always runs, so one failure does not hide another.
#   ./scripts/test.sh                 # all tests that need no GPU, then the fuzzers
#   ./scripts/test.sh -L cpu          # extra arguments go to ctest
#   ./scripts/test.sh --no-fuzz       # without the fuzzing step (also: COLLIDER_FUZZ_SECONDS=0)
#   ./scripts/test.sh --quick         # the edit-test loop: no CTest test labelled slow, no pytest
#                                     # module marked stack (whole training stacks) or zoo (every
#                                     # transformers architecture), no fuzzing
#   ./scripts/test.sh --fuzz-only     # only the fuzzing step (no build/, CTest or pytest)
#   COLLIDER_FUZZ_SECONDS=120 ./scripts/test.sh   # seconds per fuzz target (default 60)
#   COLLIDER_PYTEST_ARGS="-k trainer" ./scripts/test.sh   # extra arguments for pytest
#   ./scripts/test.sh --asan          # instead: the sanitizer build (preset asan, build-asan/) and
#                                     # its CTest unit tests without the slow and gpu labels
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
ASAN=0
FUZZ_ONLY=0
QUICK=0
FUZZ_SECONDS=${COLLIDER_FUZZ_SECONDS:-60}
CTEST_ARGS=()
PYTEST_ARGS=()
for a in "$@"; do
  case $a in
    --asan) ASAN=1 ;;
    --no-fuzz) FUZZ_SECONDS=0 ;;
    --fuzz-only) FUZZ_ONLY=1 ;;
    --quick) QUICK=1 FUZZ_SECONDS=0 ;;
    *) CTEST_ARGS+=("$a") ;;
  esac
done
if ((QUICK)); then
  CTEST_ARGS+=(-LE slow)
  PYTEST_ARGS+=(-m "not stack and not zoo")
fi
# One torch intra-op thread per test process; ctest runs two processes at once on 2 cores. (nproc
# honours this variable: the build steps count the cores without it.)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

if ((ASAN)); then
  # The library, CLI and unit tests compiled with clang, ASan and UBSan (CMakePresets.json, preset
  # asan; libtorch itself is not instrumented). The Debian packages and the Python env come from
  # bootstrap.sh, which does not build build/ here.
  ./scripts/bootstrap.sh --deps-only
  # PY, TORCH_PREFIX, LAUNCHER (ccache), shared with scripts/fuzz.sh.
  source scripts/clang_env.sh
  start=$(date +%s)
  cmake --preset asan -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" -DPython3_EXECUTABLE="$PY" "${LAUNCHER[@]}" -Wno-dev \
    >build-asan.configure.log 2>&1 || { cat build-asan.configure.log; exit 1; }
  rm -f build-asan.configure.log
  cmake --build build-asan -j "${COLLIDER_JOBS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}"
  echo "$PY" > build-asan/python_path
  echo "[test] asan: built in $(( $(date +%s) - start )) s"
  # Every ASan/UBSan finding aborts the test (-fno-sanitize-recover in CMakeLists.txt). The
  # suppressions (tests/sanitizers/) cover libtorch and other uninstrumented third-party code
  # only, each with its reason.
  SUPP=$ROOT/tests/sanitizers
  export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:symbolize=1:detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1}
  export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$SUPP/lsan.supp:print_suppressions=0}
  export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1:suppressions=$SUPP/ubsan.supp}
  start=$(date +%s)
  rc=0
  ctest --preset asan -j "${CTEST_JOBS:-2}" --timeout 1500 "${CTEST_ARGS[@]}" || rc=$?
  echo "[test] asan: tests took $(( $(date +%s) - start )) s"
  if ((rc != 0)); then echo "[test] FAILED: asan ctest exit status $rc" >&2; exit 1; fi
  exit 0
fi

# Each phase's wall time, printed as a table at the end (and written to build/phase_times.tsv for
# .ci/run) beside its budget: the budget of a fresh-machine run on 2 cores (docs/BUILD.md, "The
# budget"). A phase over its budget is flagged, not failed: the budget is for planning.
T_START=$(date +%s)
PHASE_ROWS=()
declare -A BUDGET_S=([set-up]=200 [build]=680 [ctest]=690 [pytest]=400 [fuzzing]=400)
phase_done() {  # NAME START [NOTE]
  PHASE_ROWS+=("$1"$'\t'"$(( $(date +%s) - $2 ))"$'\t'"${3:-}")
}
print_phases() {
  local row name secs note budget flag total=$(( $(date +%s) - T_START ))
  echo "[test] phase       seconds  budget (fresh machine, 2 cores)"
  for row in "${PHASE_ROWS[@]}"; do
    IFS=$'\t' read -r name secs note <<<"$row"
    budget=${BUDGET_S[$name]:-}
    flag=""; [[ -n $budget ]] && ((secs > budget)) && flag="  OVER BUDGET"
    printf '[test] %-10s %8s  %6s%s%s\n' "$name" "$secs" "${budget:--}" "${note:+  $note}" "$flag"
  done
  printf '[test] %-10s %8s\n' total "$total"
  if [[ -d build ]]; then
    { printf 'phase\tseconds\tnote\n'; printf '%s\n' "${PHASE_ROWS[@]}"; printf 'total\t%s\t\n' "$total"; } \
      >build/phase_times.tsv
  fi
}

ctest_rc=0
pytest_rc=0
t=$(date +%s)
./scripts/bootstrap.sh --deps-only
phase_done set-up "$t" "packages, Python environment"
if ((FUZZ_ONLY)); then
  PY=${COLLIDER_PYTHON:-${COLLIDER_VENV:-$HOME/.cache/collider/venv}/bin/python}
  ((FUZZ_SECONDS > 0)) || { echo "[test] --fuzz-only with COLLIDER_FUZZ_SECONDS=0 or --no-fuzz: nothing to run" >&2; exit 2; }
else
  t=$(date +%s)
  ./scripts/bootstrap.sh
  phase_done build "$t"
  PY=$(cat build/python_path)
  t=$(date +%s)
  (cd build && ctest --output-on-failure -j "${CTEST_JOBS:-2}" --timeout 1500 "${CTEST_ARGS[@]}") 2>&1 |
    tee build/ctest.log || ctest_rc=$?
  phase_done ctest "$t" "$(grep -o '[0-9]* tests failed out of [0-9]*' build/ctest.log | tail -1 || true)"
fi
if ((FUZZ_ONLY)); then
  :
elif [[ -d build/python/collider ]]; then
  # Two pytest workers (pytest-xdist, pinned by bootstrap.sh), one per core: each test is a tiny
  # model on one torch thread. COLLIDER_PYTEST_JOBS=0 runs them in this process instead.
  jobs=${COLLIDER_PYTEST_JOBS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}
  workers=()
  if ((jobs > 1)) && "$PY" -c "import xdist" 2>/dev/null; then workers=(-n "$jobs"); fi
  t=$(date +%s)
  # shellcheck disable=SC2086
  (cd "$ROOT" && "$PY" -m pytest python/tests -q -p no:cacheprovider "${workers[@]}" "${PYTEST_ARGS[@]}" \
     ${COLLIDER_PYTEST_ARGS:-}) 2>&1 | tee build/pytest.log || pytest_rc=$?
  note="in this process"; ((${#workers[@]})) && note="$jobs workers"
  note="$note, $(grep -oE '[0-9]+ passed.* in ' build/pytest.log | tail -1 | sed 's/ in $//' || true)"
  phase_done pytest "$t" "$note"
  # pytest's 5 means it collected no test: the suite exists, so that is a failure here too.
  if [[ $pytest_rc -eq 5 ]]; then echo "[test] pytest collected no tests" >&2; fi
else
  echo "[test] build/python/collider missing: the Python module was not built (apt-get install python3-dev)" >&2
  pytest_rc=1
fi
# The fuzzers from the committed seeds (plus the corpus earlier runs left in build-fuzz/corpus/):
# a crash, sanitizer report or hang fails the run (the input is kept in build-fuzz/findings/).
fuzz_rc=0
if ((FUZZ_SECONDS > 0)); then
  t=$(date +%s)
  COLLIDER_FUZZ_SECONDS=$FUZZ_SECONDS COLLIDER_PYTHON="$PY" ./scripts/fuzz.sh || fuzz_rc=$?
  phase_done fuzzing "$t" "instrumented build + ${FUZZ_SECONDS} s per target"
else
  echo "[test] fuzzing skipped (--no-fuzz or COLLIDER_FUZZ_SECONDS=0)"
fi
print_phases
if [[ $ctest_rc -ne 0 || $pytest_rc -ne 0 || $fuzz_rc -ne 0 ]]; then
  echo "[test] FAILED: ctest exit status $ctest_rc, pytest exit status $pytest_rc, fuzz exit status $fuzz_rc" >&2
  exit 1
fi
