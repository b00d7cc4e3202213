#!/usr/bin/env bash
# Sets up (scripts/bootstrap.sh), builds, runs every C++ test with CTest, then the Python package's
# tests with pytest (python/tests, on this checkout's build/python). A failure in either fails
# the command; both always run, so one failure does not hide the other.
#   ./scripts/test.sh                 # all tests that need no GPU
#   ./scripts/test.sh -L cpu          # extra arguments go to ctest
#   COLLIDER_PYTEST_ARGS="-k trainer" ./scripts/test.sh   # extra arguments for pytest
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
./scripts/bootstrap.sh
PY=$(cat build/python_path)
# One torch intra-op thread per test process; ctest runs two processes at once on 2 cores.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
ctest_rc=0
(cd build && ctest --output-on-failure -j "${CTEST_JOBS:-2}" --timeout 1500 "$@") || ctest_rc=$?
pytest_rc=0
if [[ -d build/python/collider ]]; then
  # shellcheck disable=SC2086
  (cd "$ROOT" && "$PY" -m pytest python/tests -q -p no:cacheprovider ${COLLIDER_PYTEST_ARGS:-}) || pytest_rc=$?
  # pytest's 5 means it collected no test: the suite exists, so that is a failure here too.
  if [[ $pytest_rc -eq 5 ]]; then echo "[test] pytest collected no tests" >&2; fi
else
  echo "[test] build/python/collider missing: the Python module was not built (apt-get install python3-dev)" >&2
  pytest_rc=1
fi
if [[ $ctest_rc -ne 0 || $pytest_rc -ne 0 ]]; then
  echo "[test] FAILED: ctest exit status $ctest_rc, pytest exit status $pytest_rc" >&2
  exit 1
fi
