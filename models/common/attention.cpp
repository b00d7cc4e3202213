// Grouped-query causal self-attention (see attention.h), eager and SDPA, or an AttentionHook in
// their place. Tested by tests/test_models.cpp (causality, eager == sdpa, hooks).
// Legend: B batch, T sequence, D hidden, H heads, G kv-heads, E head dim.
#include "models/common/attention.h"

#include "models/common/rotary.h"

#include <cmath>
#include <limits>

namespace collider::models::detail {

SelfAttentionImpl::SelfAttentionImpl(const AttentionOptions& o) : opt(o) {
  TORCH_CHECK(o.num_heads > 0 && o.num_kv_heads > 0 && o.num_heads % o.num_kv_heads == 0,
              "attention needs num_heads divisible by num_kv_heads, got ", o.num_heads, " and ", o.num_kv_heads);
  const int64_t qd = o.num_heads * o.head_dim, kvd = o.num_kv_heads * o.head_dim;
  q_proj = register_module("q_proj", Linear(o.hidden, qd, o.qkv_bias));
  k_proj = register_module("k_proj", Linear(o.hidden, kvd, o.qkv_bias));
  v_proj = register_module("v_proj", Linear(o.hidden, kvd, o.qkv_bias));
  out_proj = register_module(o.out_name, Linear(qd, o.hidden, o.out_bias));
}

torch::Tensor expand_kv_heads(const torch::Tensor& k_BGTE, int64_t num_heads) {
  const int64_t B = k_BGTE.size(0), G = k_BGTE.size(1), T = k_BGTE.size(2), E = k_BGTE.size(3);
  if (G == num_heads) return k_BGTE;
  return k_BGTE.unsqueeze(2).expand({B, G, num_heads / G, T, E}).reshape({B, num_heads, T, E});
}

EagerAttention eager_attention(const torch::Tensor& q_BHTE, const torch::Tensor& k_BHTE, const torch::Tensor& v_BHTE,
                               const torch::Tensor& mask_TT, double scale) {
  auto s_BHTT = torch::matmul(q_BHTE, k_BHTE.transpose(-2, -1)) * scale;
  s_BHTT = s_BHTT.masked_fill(mask_TT, -std::numeric_limits<double>::infinity());
  EagerAttention r;
  r.p_c = torch::softmax(s_BHTT, -1, compute_dtype(q_BHTE.scalar_type()));
  r.p = r.p_c.to(q_BHTE.scalar_type());
  r.o = torch::matmul(r.p, v_BHTE);
  return r;
}

torch::Tensor attention_core(const torch::Tensor& q_BHTE, const torch::Tensor& k_BGTE, const torch::Tensor& v_BGTE,
                             const ForwardContext& ctx) {
  const int64_t H = q_BHTE.size(1), E = q_BHTE.size(3);
  const double scale = std::pow(static_cast<double>(E), -0.5);  // HF: head_dim ** -0.5
  if (ctx.attention_hook) return (*ctx.attention_hook)({q_BHTE, k_BGTE, v_BGTE, ctx.causal_mask_TT, scale, ctx.attn});
  if (ctx.attn == AttentionImpl::kSdpa) {
    return torch::scaled_dot_product_attention(q_BHTE, expand_kv_heads(k_BGTE, H), expand_kv_heads(v_BGTE, H), {}, 0.0,
                                               /*is_causal=*/true, scale);
  }
  return eager_attention(q_BHTE, expand_kv_heads(k_BGTE, H), expand_kv_heads(v_BGTE, H), ctx.causal_mask_TT, scale).o;
}

torch::Tensor SelfAttentionImpl::forward(const torch::Tensor& x_BTD, const ForwardContext& ctx) const {
  const int64_t B = x_BTD.size(0), T = x_BTD.size(1);
  const int64_t H = opt.num_heads, G = opt.num_kv_heads, E = opt.head_dim;
  auto q_BHTE = q_proj->forward(x_BTD).view({B, T, H, E}).transpose(1, 2);
  auto k_BGTE = k_proj->forward(x_BTD).view({B, T, G, E}).transpose(1, 2);
  auto v_BGTE = v_proj->forward(x_BTD).view({B, T, G, E}).transpose(1, 2);
  q_BHTE = apply_rotary(q_BHTE, ctx.cos_TR, ctx.sin_TR);
  k_BGTE = apply_rotary(k_BGTE, ctx.cos_TR, ctx.sin_TR);
  auto o_BHTE = attention_core(q_BHTE, k_BGTE, v_BGTE, ctx);
  auto o_BTD = o_BHTE.transpose(1, 2).contiguous().reshape({B, T, H * E});
  return out_proj->forward(o_BTD);
}

}  // namespace collider::models::detail
