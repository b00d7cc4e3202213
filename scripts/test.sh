#!/usr/bin/env bash
# Sets up (scripts/bootstrap.sh), builds, and runs every test with CTest.
#   ./scripts/test.sh                 # all tests that need no GPU
#   ./scripts/test.sh -L cpu          # extra arguments go to ctest
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
cd build
# One torch intra-op thread per test process; ctest runs two processes at once on 2 cores.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
ctest --output-on-failure -j "${CTEST_JOBS:-2}" --timeout 1500 "$@"
