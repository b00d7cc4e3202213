// Rotary position embedding (RoPE), full (Llama, Qwen2) and partial (Phi: the first R of E
// head dims rotated, the rest passed through), in Hugging Face's rotate_half convention:
// x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[R/2:], x[:R/2]).
// The cos/sin tables are computed fresh for positions 0..T-1 without grad (never sliced from a
// grad-carrying tensor), in fp32 as HF does, then cast to the activations' dtype.
// Tested by tests/test_models.cpp. Legend: B batch, H heads, T sequence, E head dim, R rotary dims.
#pragma once

#include <torch/torch.h>

#include <utility>

namespace collider::models::detail {

// cos_TR, sin_TR for positions 0..T-1: inv_freq_j = 1 / theta^(2j/R), angle = t * inv_freq_j,
// duplicated to R columns (cat(freqs, freqs)). Computed in fp32 then cast to `dtype`.
std::pair<torch::Tensor, torch::Tensor> rotary_tables(int64_t T, int64_t rotary_dim, double theta,
                                                      torch::ScalarType dtype, torch::Device device);

// x_BHTE with the first R = cos_TR.size(-1) dims of each head rotated (R == E: full rotary).
// cos_TR / sin_TR: [T, R] (positions 0..T-1, shared by every row) or [B, T, R] (each row's own
// positions: the middle layers of forward token dropping see a subset of each row's tokens).
torch::Tensor apply_rotary(const torch::Tensor& x_BHTE, const torch::Tensor& cos_TR, const torch::Tensor& sin_TR);

}  // namespace collider::models::detail
