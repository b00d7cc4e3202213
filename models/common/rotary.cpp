// Rotary position embedding (see rotary.h), op for op as HF transformers'
// _compute_default_rope_parameters + LlamaRotaryEmbedding.forward + apply_rotary_pos_emb.
// Tested by tests/test_models.cpp. Legend: B batch, H heads, T sequence, E head dim, R rotary dims.
#include "models/common/rotary.h"

namespace collider::models::detail {

std::pair<torch::Tensor, torch::Tensor> rotary_tables(int64_t T, int64_t rotary_dim, double theta,
                                                      torch::ScalarType dtype, torch::Device device) {
  TORCH_CHECK(rotary_dim > 0 && rotary_dim % 2 == 0, "rotary dims must be positive and even, got ", rotary_dim,
              "; check head_dim and partial_rotary_factor");
  torch::NoGradGuard no_grad;
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat).device(device);
  // HF: inv_freq = 1.0 / (base ** (arange(0, dim, 2, dtype=int64).float() / dim))
  auto exponent =
      torch::arange(0, rotary_dim, 2, torch::TensorOptions().dtype(torch::kLong).device(device)).to(torch::kFloat) /
      rotary_dim;
  auto inv_freq = torch::reciprocal(torch::pow(theta, exponent));  // [R/2]
  auto pos_T = torch::arange(T, f32);
  auto freqs_TR2 = pos_T.unsqueeze(1) * inv_freq.unsqueeze(0);  // == HF's k=1 matmul, exactly
  auto emb_TR = torch::cat({freqs_TR2, freqs_TR2}, -1);
  return {emb_TR.cos().to(dtype), emb_TR.sin().to(dtype)};
}

namespace {
// HF: cat(-x[..., R/2:], x[..., :R/2]). Split (chunk) instead of slicing: the same values, and a
// SplitBackward node that the token-dimension rewriter accepts (it refuses every SliceBackward on
// a token-shaped tensor, whatever the sliced dimension).
torch::Tensor rotate_half(const torch::Tensor& x) {
  auto halves = x.chunk(2, -1);
  return torch::cat({-halves[1], halves[0]}, -1);
}
}  // namespace

torch::Tensor apply_rotary(const torch::Tensor& x_BHTE, const torch::Tensor& cos_TR, const torch::Tensor& sin_TR) {
  const int64_t E = x_BHTE.size(-1), R = cos_TR.size(-1);
  TORCH_CHECK(R <= E, "rotary table has ", R, " dims but heads have only ", E);
  TORCH_CHECK(cos_TR.size(-2) == x_BHTE.size(-2), "rotary table covers ", cos_TR.size(-2),
              " positions but the sequence has ", x_BHTE.size(-2));
  // [1, 1, T, R] (or [B, 1, T, R] for per-row positions), as HF's cos.unsqueeze(1): the token
  // dim sits where it sits in x.
  const bool per_row = cos_TR.dim() == 3;
  auto cos = per_row ? cos_TR.unsqueeze(1) : cos_TR.unsqueeze(0).unsqueeze(0);
  auto sin = per_row ? sin_TR.unsqueeze(1) : sin_TR.unsqueeze(0).unsqueeze(0);
  if (R == E) return x_BHTE * cos + rotate_half(x_BHTE) * sin;
  // Phi: split along the head dim only (never the token dim).
  auto parts = x_BHTE.split_with_sizes({R, E - R}, -1);
  const auto& rot = parts[0];
  return torch::cat({rot * cos + rotate_half(rot) * sin, parts[1]}, -1);
}

}  // namespace collider::models::detail
