// Analytic GEMM FLOPs (formulas in flops.h, next to the declarations), on a FlopShape: this
// file needs neither the model zoo nor libtorch's kernels, so the Python bindings compile it too
// (python/CMakeLists.txt) and the Python benchmark counts with the same formulas. The ModelConfig
// overloads are in flop_shape.cpp. Tested by tests/test_flops.cpp.
// Legend: B batch, T sequence, N kept tokens per row, D hidden, H heads, G kv-heads, E head dim,
// F ffn, V vocab, L layers.
#include "models/flops.h"

#include <fmt/format.h>

#include <stdexcept>

namespace collider::models {

namespace {

// Forward FLOPs of the decoder projections per token, summed over layers.
double linear_flops_per_token(const FlopShape& c) {
  const double D = c.hidden_size, F = c.intermediate_size, H = c.num_heads, G = c.num_kv_heads, E = c.head_dim;
  // A mixture of experts: each token's K experts (routed work only) and the router's D x X.
  const double routes = c.experts_per_token > 0 ? static_cast<double>(c.experts_per_token) : 1.0;
  const double mlp_flops = routes * c.mlp_matrices * D * F + D * c.num_experts;
  return 2.0 * c.num_layers * (D * H * E + 2 * D * G * E + H * E * D + mlp_flops);
}

// One GEMM of the attention core (Q K^T or P V) with Tq query rows and Tk key rows, all layers.
double attention_gemm_flops(const FlopShape& c, int64_t B, int64_t Tq, int64_t Tk) {
  return 2.0 * c.num_layers * static_cast<double>(B) * c.num_heads * static_cast<double>(Tq) * Tk * c.head_dim;
}

void check_sizes(int64_t B, int64_t T) {
  if (B <= 0 || T <= 0)
    throw std::invalid_argument(
        fmt::format("FLOP count needs positive batch and sequence length, got B={} T={}", B, T));
}

}  // namespace

FlopCount forward_flops(const FlopShape& cfg, int64_t B, int64_t T) {
  check_sizes(B, T);
  const double tokens = static_cast<double>(B) * T;
  FlopCount f;
  f.linear = tokens * linear_flops_per_token(cfg);
  f.attention = 2 * attention_gemm_flops(cfg, B, T, T);
  f.lm_head = 2.0 * tokens * cfg.hidden_size * cfg.vocab_size;
  return f;
}

FlopCount forward_flops(const FlopShape& cfg, int64_t B, int64_t T, int64_t N, const MethodSpec& spec) {
  return spec.method == Method::kForwardDrop ? forward_drop_forward_flops(cfg, B, T, N) : forward_flops(cfg, B, T);
}

FlopCount backward_flops(const FlopShape& cfg, int64_t B, int64_t T, int64_t N, const MethodSpec& spec) {
  check_sizes(B, T);
  if (spec.method == Method::kForwardDrop) return forward_drop_backward_flops(cfg, B, T, N);
  FlopCount f;
  if (spec.method != Method::kCollider) {  // the others run the dense backward
    const FlopCount fwd = forward_flops(cfg, B, T);
    f.linear = 2 * fwd.linear;
    f.attention = 2 * fwd.attention;
    f.lm_head = 2 * fwd.lm_head;
    return f;
  }
  if (N <= 0 || N > T) throw std::invalid_argument(fmt::format("kept count N must be in [1, T={}], got {}", T, N));
  const FlopCount kept = forward_flops(cfg, B, N);  // token-wise GEMMs on the kept rows
  f.linear = 2 * kept.linear;
  f.lm_head = 2 * kept.lm_head;
  f.attention = spec.attention_grad == collider::AttentionGrad::kKeptOnly ? 4 * attention_gemm_flops(cfg, B, N, N)
                                                                          : 4 * attention_gemm_flops(cfg, B, N, T);
  return f;
}

FlopCount backward_flops_rows(const FlopShape& cfg, int64_t T, const std::vector<int64_t>& kept_per_row,
                              const MethodSpec& spec) {
  if (kept_per_row.empty()) throw std::invalid_argument("backward_flops_rows: no rows");
  const int64_t B = static_cast<int64_t>(kept_per_row.size());
  if (spec.method != Method::kCollider) return backward_flops(cfg, B, T, kept_per_row.front(), spec);
  FlopCount sum{};
  for (int64_t N : kept_per_row) {
    if (N == 0) continue;  // a row that keeps nothing has no backward
    const FlopCount f = backward_flops(cfg, 1, T, N, spec);
    sum.linear += f.linear;
    sum.attention += f.attention;
    sum.lm_head += f.lm_head;
  }
  return sum;
}

double flop_ideal_reduction(const FlopShape& cfg, int64_t T, const std::vector<int64_t>& kept_per_row,
                            const MethodSpec& spec) {
  const int64_t B = static_cast<int64_t>(kept_per_row.size());
  return 1.0 -
         backward_flops_rows(cfg, T, kept_per_row, spec).total() / backward_flops(cfg, B, T, T, MethodSpec{}).total();
}

FlopCount forward_drop_forward_flops(const FlopShape& cfg, int64_t B, int64_t T, int64_t N) {
  check_sizes(B, T);
  if (cfg.num_layers < 3)
    throw std::invalid_argument(
        fmt::format("forward_drop needs at least 3 decoder layers, {} has {}", cfg.name, cfg.num_layers));
  if (N <= 0 || N > T)
    throw std::invalid_argument(
        fmt::format("forward_drop's middle-layer token count N must be in [1, T={}], got {}", T, N));
  FlopShape outer = cfg, middle = cfg;
  outer.num_layers = 2;  // the first and the last layer, every token
  middle.num_layers = cfg.num_layers - 2;
  const FlopCount all = forward_flops(outer, B, T), some = forward_flops(middle, B, N);
  FlopCount f;
  f.linear = all.linear + some.linear;
  f.attention = all.attention + some.attention;
  f.lm_head = all.lm_head;
  return f;
}

FlopCount forward_drop_backward_flops(const FlopShape& cfg, int64_t B, int64_t T, int64_t N) {
  const FlopCount fwd = forward_drop_forward_flops(cfg, B, T, N);
  FlopCount f;
  f.linear = 2 * fwd.linear;
  f.attention = 2 * fwd.attention;
  f.lm_head = 2 * fwd.lm_head;
  return f;
}

double attention_linear_ratio(const FlopShape& cfg, int64_t T) {
  const FlopCount f = forward_flops(cfg, 1, T);
  return f.attention / f.linear;
}

}  // namespace collider::models
