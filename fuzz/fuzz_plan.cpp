// libFuzzer target: collider::Plan::from_string on arbitrary text (a saved plan read back; the
// format is at the top of collider_core/src/plan.cpp). A rejection must be a collider::Error;
// any other exception, a crash or a sanitizer report is a bug. An accepted plan must print and
// re-read to the same text.
// The checks are in fuzz/fuzz_checks.h (check_plan), shared with tests/test_fuzz_regressions.cpp.
// Build and run: scripts/fuzz.sh (clang, ASan + UBSan, build-fuzz/; seeds in fuzz/seeds/plan/,
// dictionary fuzz/plan.dict):
//   ./scripts/fuzz.sh fuzz_plan
//   build-fuzz/fuzz/fuzz_plan build-fuzz/corpus/fuzz_plan fuzz/seeds/plan -dict=fuzz/plan.dict -max_total_time=60
// A finding is written to build-fuzz/findings/fuzz_plan/; replay it by passing the file.
#include "fuzz/fuzz_checks.h"

#include <cstdio>
#include <cstdlib>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    collider::fuzz::check_plan(data, size);
  } catch (const collider::fuzz::Violation& v) {
    std::fprintf(stderr, "fuzz check failed: %s\n", v.what.c_str());
    std::abort();
  }
  return 0;
}
