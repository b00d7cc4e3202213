// The linear projections of the paper's three models at paper scale (the widths of their Hugging
// Face configs), the one table the GEMM micro-benchmarks share (bm_backward_gemm.cpp: all three
// models; bm_cublas_gemm.cu: TinyLlama-1.1B's). Plain C++, no torch, so nvcc compiles it too.
// TinyLlama-1.1B: D=2048, F=5632, 4 KV heads x 64 = 256. Qwen2.5-1.5B: D=1536, F=8960, 2 KV heads
// x 128 = 256. Phi-1.5: D=2048, F=8192, multi-head attention (q/k/v all D), `dense` output, fc1/fc2.
// Legend: K input width, M output width (y_TM = x_TK · W_MKᵀ).
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

namespace collider::bench {

struct Projection {
  const char* model;
  const char* layer;
  int64_t in_K;
  int64_t out_M;
};

inline const std::vector<Projection>& paper_projections() {
  static const std::vector<Projection> table = {
      {"tinyllama-1.1b", "q_proj", 2048, 2048},  {"tinyllama-1.1b", "k_proj", 2048, 256},
      {"tinyllama-1.1b", "v_proj", 2048, 256},   {"tinyllama-1.1b", "o_proj", 2048, 2048},
      {"tinyllama-1.1b", "gate_proj", 2048, 5632}, {"tinyllama-1.1b", "up_proj", 2048, 5632},
      {"tinyllama-1.1b", "down_proj", 5632, 2048}, {"qwen2.5-1.5b", "q_proj", 1536, 1536},
      {"qwen2.5-1.5b", "k_proj", 1536, 256},     {"qwen2.5-1.5b", "v_proj", 1536, 256},
      {"qwen2.5-1.5b", "o_proj", 1536, 1536},    {"qwen2.5-1.5b", "gate_proj", 1536, 8960},
      {"qwen2.5-1.5b", "up_proj", 1536, 8960},   {"qwen2.5-1.5b", "down_proj", 8960, 1536},
      {"phi-1.5", "q_proj", 2048, 2048},         {"phi-1.5", "k_proj", 2048, 2048},
      {"phi-1.5", "v_proj", 2048, 2048},         {"phi-1.5", "dense", 2048, 2048},
      {"phi-1.5", "fc1", 2048, 8192},            {"phi-1.5", "fc2", 8192, 2048},
  };
  return table;
}

// The projections of one model, in the table's order.
inline std::vector<Projection> projections_of(const char* model) {
  std::vector<Projection> out;
  for (const Projection& p : paper_projections())
    if (std::strcmp(p.model, model) == 0) out.push_back(p);
  return out;
}

}  // namespace collider::bench
