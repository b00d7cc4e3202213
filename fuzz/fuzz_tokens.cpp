// libFuzzer target: the token-file readers of training runs (harness/components/token_data.h) on arbitrary
// bytes: a token shard (CLDRTOK1, written by scripts/prepare_data.py) and a reference-loss file
// (CLDRREF1), each memory-mapped from a memfd as from disk. A rejection must be a
// std::runtime_error naming the file; an accepted file must read its first and last ids, a slice
// and a window batch, inside the mapping.
// The checks are in fuzz/fuzz_checks.h (check_tokens), shared with tests/test_fuzz_regressions.cpp.
// Build and run: scripts/fuzz.sh (clang, ASan + UBSan, build-fuzz/; seeds in fuzz/seeds/tokens/,
// dictionary fuzz/tokens.dict):
//   ./scripts/fuzz.sh fuzz_tokens
//   build-fuzz/fuzz/fuzz_tokens build-fuzz/corpus/fuzz_tokens fuzz/seeds/tokens -dict=fuzz/tokens.dict -max_total_time=60
// A finding is written to build-fuzz/findings/fuzz_tokens/; replay it by passing the file.
#include "fuzz/fuzz_checks.h"

#include <cstdio>
#include <cstdlib>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    collider::fuzz::check_tokens(data, size);
  } catch (const collider::fuzz::Violation& v) {
    std::fprintf(stderr, "fuzz check failed: %s\n", v.what.c_str());
    std::abort();
  }
  return 0;
}
