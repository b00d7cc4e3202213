// libFuzzer target: the manifest loaders `collider run` uses, on arbitrary TOML text plus
// --set overrides. The input is TOML, optionally followed by a line "#--set" and then lines
// "--set key=value" (so the fuzzer mutates both). Timing manifests go through load_manifest_text
// (an accepted one has points, and its resolved form loads to the same points); text with a
// [train] table also through load_train_manifest. A rejection must be a ManifestError; anything
// else (another exception, a crash, a sanitizer report) is a bug.
// The checks are in fuzz/fuzz_checks.h (check_manifest), shared with tests/test_fuzz_regressions.cpp.
// Build and run: scripts/fuzz.sh (clang, ASan + UBSan, build-fuzz/; seeds in fuzz/seeds/manifest/,
// dictionary fuzz/manifest.dict):
//   ./scripts/fuzz.sh fuzz_manifest
//   build-fuzz/fuzz/fuzz_manifest build-fuzz/corpus/fuzz_manifest fuzz/seeds/manifest -dict=fuzz/manifest.dict -max_total_time=60
// A finding is written to build-fuzz/findings/fuzz_manifest/; replay it by passing the file.
#include "fuzz/fuzz_checks.h"

#include <cstdio>
#include <cstdlib>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    collider::fuzz::check_manifest(data, size);
  } catch (const collider::fuzz::Violation& v) {
    std::fprintf(stderr, "fuzz check failed: %s\n", v.what.c_str());
    std::abort();
  }
  return 0;
}
