// Grouped-query causal self-attention (see attention.h), eager and SDPA, plus the attention
// oracles of DESIGN.md section 3 (reference semantics for tests, independent of the rewriter).
// Tested by tests/test_models.cpp (causality, eager == sdpa, oracle == autograd at keep all-true).
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

namespace {

struct EagerResult {
  torch::Tensor p_c;  // softmax probabilities in the compute dtype (fp32, or double) [B, H, T, T]
  torch::Tensor p;    // the same in q's dtype (what multiplies V)
  torch::Tensor o;    // [B, H, T, E]
};

// The eager attention graph, op for op as HF's eager_attention_forward (masked_fill with -inf
// instead of adding the dtype's min: both give exactly 0 after softmax).
EagerResult eager_attention(const torch::Tensor& q_BHTE, const torch::Tensor& k_BHTE, const torch::Tensor& v_BHTE,
                            const torch::Tensor& mask_TT, double scale) {
  auto s_BHTT = torch::matmul(q_BHTE, k_BHTE.transpose(-2, -1)) * scale;
  s_BHTT = s_BHTT.masked_fill(mask_TT, -std::numeric_limits<double>::infinity());
  EagerResult r;
  r.p_c = torch::softmax(s_BHTT, -1, compute_dtype(q_BHTE.scalar_type()));
  r.p = r.p_c.to(q_BHTE.scalar_type());
  r.o = torch::matmul(r.p, v_BHTE);
  return r;
}

// kept_only oracle (DESIGN.md section 3): forward is ordinary attention; backward applies the
// section-3 formulas on full-size tensors with dropped rows and columns zeroed:
//   P_m = P * keep_i * keep_j; dO rows of dropped tokens zeroed; dV = P_m^T dO; dP = dO V^T;
//   dS = P_m * (dP - rowsum(dP * P_m)); dQ = dS K / sqrt(E); dK = dS^T Q / sqrt(E).
// The op order mirrors autograd's for the plain eager graph, so keep all-true reproduces it.
struct KeptOnlyAttention : public torch::autograd::Function<KeptOnlyAttention> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q_BHTE,
                               const torch::Tensor& k_BHTE, const torch::Tensor& v_BHTE, const torch::Tensor& keep_BT,
                               const torch::Tensor& mask_TT, double scale) {
    auto r = eager_attention(q_BHTE, k_BHTE, v_BHTE, mask_TT, scale);
    ctx->save_for_backward({q_BHTE, k_BHTE, v_BHTE, r.p_c, keep_BT, mask_TT});
    ctx->saved_data["scale"] = scale;
    return r.o;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &p_c = saved[3], &keep_BT = saved[4], &mask_TT = saved[5];
    const double scale = ctx->saved_data["scale"].toDouble();
    const int64_t B = keep_BT.size(0), T = keep_BT.size(1);
    const auto dtype = q.scalar_type(), cdtype = p_c.scalar_type();
    auto keep_c = keep_BT.to(cdtype);
    auto pm_c = p_c * keep_c.view({B, 1, T, 1}) * keep_c.view({B, 1, 1, T});  // P_m [B, H, T, T]
    auto pm = pm_c.to(dtype);
    auto dO = grad_out[0] * keep_BT.to(dtype).view({B, 1, T, 1});  // dropped query rows zeroed
    // Explicit bmm on [B*H, ., .] operands laid out as at::matmul lays them out in the forward
    // (reshape of the GQA-expanded K, V copies them), so that each GEMM sees the same operands as
    // autograd's BmmBackward: at keep all-true the gradients equal ordinary autograd bit for bit.
    const int64_t H = q.size(1), E = q.size(3);
    auto q3 = q.reshape({B * H, T, E});
    auto kT3 = k.transpose(-2, -1).reshape({B * H, E, T});
    auto v3 = v.reshape({B * H, T, E});
    auto dO3 = dO.reshape({B * H, T, E});
    auto dV = pm.reshape({B * H, T, T}).transpose(1, 2).bmm(dO3).view({B, H, T, E});
    auto dP = dO3.bmm(v3.transpose(1, 2)).view({B, H, T, T});
    // P_m * (dP - rowsum(dP * P_m)), with the kernel autograd's SoftmaxBackward uses.
    auto dS = torch::_softmax_backward_data(dP.to(cdtype), pm_c, -1, cdtype).to(dtype);
    auto dS3 = (dS.masked_fill(mask_TT, 0) * scale).reshape({B * H, T, T});
    auto dQ = dS3.bmm(kT3.transpose(1, 2)).view({B, H, T, E});
    auto dK = q3.transpose(1, 2).bmm(dS3).view({B, H, E, T}).transpose(-2, -1);
    return {dQ, dK, dV, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor attention_core(const torch::Tensor& q_BHTE, const torch::Tensor& k_BGTE, const torch::Tensor& v_BGTE,
                             const ForwardContext& ctx) {
  const int64_t B = q_BHTE.size(0), H = q_BHTE.size(1), T = q_BHTE.size(2), E = q_BHTE.size(3);
  const double scale = std::pow(static_cast<double>(E), -0.5);  // HF: head_dim ** -0.5
  if (ctx.attn == AttentionImpl::kSdpa) {
    TORCH_CHECK(ctx.oracle == nullptr,
                "the attention oracle defines an eager backward; build the model with AttentionImpl::kEager");
    return torch::scaled_dot_product_attention(q_BHTE, expand_kv_heads(k_BGTE, H), expand_kv_heads(v_BGTE, H), {},
                                               0.0, /*is_causal=*/true, scale);
  }
  torch::Tensor k = k_BGTE, v = v_BGTE;
  torch::Tensor keep_BT;
  if (ctx.oracle) {
    keep_BT = ctx.oracle->keep_BT;
    TORCH_CHECK(keep_BT.defined() && keep_BT.scalar_type() == torch::kBool && keep_BT.dim() == 2 &&
                    keep_BT.size(0) == B && keep_BT.size(1) == T,
                "AttentionOracle::keep_BT must be a bool [B, T] = [", B, ", ", T, "] tensor, got ",
                keep_BT.defined() ? keep_BT.sizes() : torch::IntArrayRef{});
    keep_BT = keep_BT.to(q_BHTE.device());
    if (ctx.oracle->exact_query) {
      // exact_query: K and V rows of dropped tokens detached, before the GQA expand.
      auto keep_B1T1 = keep_BT.view({B, 1, T, 1});
      k = torch::where(keep_B1T1, k, k.detach());
      v = torch::where(keep_B1T1, v, v.detach());
    }
  }
  k = expand_kv_heads(k, H);
  v = expand_kv_heads(v, H);
  if (ctx.oracle && !ctx.oracle->exact_query) {
    return KeptOnlyAttention::apply(q_BHTE, k, v, keep_BT, ctx.causal_mask_TT, scale);
  }
  return eager_attention(q_BHTE, k, v, ctx.causal_mask_TT, scale).o;
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
