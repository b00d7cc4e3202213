// Grouped-query causal self-attention with rotary embedding, shared by Llama, Qwen2 and Phi.
// Eager (AttentionImpl::kEager) is an explicit graph the token-dimension rewriter understands:
// projections viewed [B,T,H,E] -> [B,H,T,E], RoPE, GQA by unsqueeze/expand/reshape,
// matmul * 1/sqrt(E), masked_fill(causal, -inf), softmax in fp32, matmul, transpose back,
// output projection. kSdpa calls torch's scaled_dot_product_attention(is_causal=true).
// An AttentionHook (model.h) replaces the core; the tests' attention oracle is one
// (tests/model_attention_oracle.h). Tested by tests/test_models.cpp.
// Legend: B batch, T sequence, D hidden, H heads, G kv-heads, E head dim, R rotary dims.
#pragma once

#include "models/common/blocks.h"

#include <string>

namespace collider::models::detail {

struct AttentionOptions {
  int64_t hidden = 0;               // D
  int64_t num_heads = 0;            // H
  int64_t num_kv_heads = 0;         // G
  int64_t head_dim = 0;             // E
  bool qkv_bias = false;            // bias on q/k/v projections
  bool out_bias = false;            // bias on the output projection
  std::string out_name = "o_proj";  // HF name of the output projection ("dense" in Phi)
};

class SelfAttentionImpl : public torch::nn::Module {
 public:
  explicit SelfAttentionImpl(const AttentionOptions& opt);
  torch::Tensor forward(const torch::Tensor& x_BTD, const ForwardContext& ctx) const;

  AttentionOptions opt;
  Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, out_proj{nullptr};
};

// The attention core on already-projected, rotated heads: q_BHTE, k_BGTE, v_BGTE -> o_BHTE.
// Exposed for tests and micro-benchmarks.
torch::Tensor attention_core(const torch::Tensor& q_BHTE, const torch::Tensor& k_BGTE, const torch::Tensor& v_BGTE,
                             const ForwardContext& ctx);

// The eager core's forward, op for op as HF's eager_attention_forward (masked_fill with -inf
// instead of adding the dtype's min: both give exactly 0 after softmax), on heads already
// GQA-expanded: q_BHTE, k_BHTE, v_BHTE [B, H, T, E], mask_TT bool [T, T] (true: masked). Shared
// with the tests' oracle so that its forward is the model's to the bit.
struct EagerAttention {
  torch::Tensor p_c;  // softmax probabilities in the compute dtype (fp32, or double) [B, H, T, T]
  torch::Tensor p;    // the same in q's dtype (what multiplies V)
  torch::Tensor o;    // [B, H, T, E]
};
EagerAttention eager_attention(const torch::Tensor& q_BHTE, const torch::Tensor& k_BHTE, const torch::Tensor& v_BHTE,
                               const torch::Tensor& mask_TT, double scale);

// k_BGTE -> k_BHTE by k.unsqueeze(2).expand({B, G, H/G, T, E}).reshape({B, H, T, E}) (HF repeat_kv).
torch::Tensor expand_kv_heads(const torch::Tensor& k_BGTE, int64_t num_heads);

}  // namespace collider::models::detail
