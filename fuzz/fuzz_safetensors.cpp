// libFuzzer target: parses arbitrary bytes as a safetensors file with our reader
// (models/safetensors.h, in-memory API) and, when they are accepted, copies every tensor out and
// checks that writing them again and re-reading gives the same bytes. A rejection must be a
// SafetensorsError; any other exception, a crash or a sanitizer report is a bug.
// The checks are in fuzz/fuzz_checks.h (check_safetensors), shared with tests/test_fuzz_regressions.cpp.
// Build and run: scripts/fuzz.sh (clang, ASan + UBSan, build-fuzz/; seeds in fuzz/seeds/safetensors/,
// dictionary fuzz/safetensors.dict):
//   ./scripts/fuzz.sh fuzz_safetensors
//   build-fuzz/fuzz/fuzz_safetensors build-fuzz/corpus/fuzz_safetensors fuzz/seeds/safetensors -dict=fuzz/safetensors.dict -max_total_time=60
// A finding is written to build-fuzz/findings/fuzz_safetensors/; replay it by passing the file.
#include "fuzz/fuzz_checks.h"

#include <cstdio>
#include <cstdlib>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    collider::fuzz::check_safetensors(data, size);
  } catch (const collider::fuzz::Violation& v) {
    std::fprintf(stderr, "fuzz check failed: %s\n", v.what.c_str());
    std::abort();
  }
  return 0;
}
