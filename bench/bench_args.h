// Command-line helpers shared by the Google Benchmark executables (bm_backward_gemm.cpp,
// bm_cublas_gemm.cu): plain C++, no torch, so nvcc compiles it too.
#pragma once

#include <cstring>
#include <vector>

namespace collider::bench {

// True when some argument (after argv[0]) starts with `prefix`.
inline bool has_flag(int argc, char** argv, const char* prefix) {
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], prefix, std::strlen(prefix)) == 0) return true;
  }
  return false;
}

// argv with a 0.2 s burn-in per benchmark (--benchmark_min_warmup_time=0.2) unless the user
// passed their own; ends with a nullptr, which argc_of() does not count.
inline std::vector<char*> with_default_warmup(int argc, char** argv) {
  static char warmup_flag[] = "--benchmark_min_warmup_time=0.2";
  std::vector<char*> args(argv, argv + argc);
  if (!has_flag(argc, argv, "--benchmark_min_warmup_time")) args.push_back(warmup_flag);
  args.push_back(nullptr);
  return args;
}
inline int argc_of(const std::vector<char*>& args) { return static_cast<int>(args.size()) - 1; }

}  // namespace collider::bench
