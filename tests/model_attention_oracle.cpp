// The attention oracle for our models (see model_attention_oracle.h): the kept_only backward as
// an autograd Function on the model's own eager forward, exact_query as detached K and V rows.
// Tested through tests/test_models.cpp (keep all-true gives autograd bit for bit; the section-3
// formulas on the kept index set).
#include "model_attention_oracle.h"

#include "models/common/attention.h"

namespace collider::testing {

namespace {

namespace d = collider::models::detail;

// kept_only oracle (DESIGN.md section 3): forward is ordinary attention; backward applies the
// section-3 formulas on full-size tensors with dropped rows and columns zeroed:
//   P_m = P * keep_i * keep_j; dO rows of dropped tokens zeroed; dV = P_m^T dO; dP = dO V^T;
//   dS = P_m * (dP - rowsum(dP * P_m)); dQ = dS K / sqrt(E); dK = dS^T Q / sqrt(E).
// The op order mirrors autograd's for the plain eager graph, so keep all-true reproduces it.
struct KeptOnlyAttention : public torch::autograd::Function<KeptOnlyAttention> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q_BHTE,
                               const torch::Tensor& k_BHTE, const torch::Tensor& v_BHTE, const torch::Tensor& keep_BT,
                               const torch::Tensor& mask_TT, double scale) {
    auto r = d::eager_attention(q_BHTE, k_BHTE, v_BHTE, mask_TT, scale);
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

torch::Tensor oracle_attention(const AttentionOracle& oracle, const models::AttentionCoreInputs& in) {
  const torch::Tensor& q_BHTE = in.q_BHTE;
  const int64_t B = q_BHTE.size(0), H = q_BHTE.size(1), T = q_BHTE.size(2);
  TORCH_CHECK(in.impl != models::AttentionImpl::kSdpa,
              "the attention oracle defines an eager backward; build the model with AttentionImpl::kEager");
  torch::Tensor k = in.k_BGTE, v = in.v_BGTE;
  torch::Tensor keep_BT = oracle.keep_BT;
  TORCH_CHECK(keep_BT.defined() && keep_BT.scalar_type() == torch::kBool && keep_BT.dim() == 2 &&
                  keep_BT.size(0) == B && keep_BT.size(1) == T,
              "AttentionOracle::keep_BT must be a bool [B, T] = [", B, ", ", T, "] tensor, got ",
              keep_BT.defined() ? keep_BT.sizes() : torch::IntArrayRef{});
  keep_BT = keep_BT.to(q_BHTE.device());
  if (oracle.exact_query) {
    // exact_query: K and V rows of dropped tokens detached, before the GQA expand.
    auto keep_B1T1 = keep_BT.view({B, 1, T, 1});
    k = torch::where(keep_B1T1, k, k.detach());
    v = torch::where(keep_B1T1, v, v.detach());
  }
  k = d::expand_kv_heads(k, H);
  v = d::expand_kv_heads(v, H);
  if (!oracle.exact_query) return KeptOnlyAttention::apply(q_BHTE, k, v, keep_BT, in.causal_mask_TT, in.scale);
  return d::eager_attention(q_BHTE, k, v, in.causal_mask_TT, in.scale).o;
}

}  // namespace

models::AttentionHook attention_oracle_hook(AttentionOracle oracle) {
  return [oracle = std::move(oracle)](const models::AttentionCoreInputs& in) { return oracle_attention(oracle, in); };
}

void set_attention_oracle(models::CausalLMImpl& model, std::optional<AttentionOracle> oracle) {
  model.set_attention_hook(oracle ? attention_oracle_hook(std::move(*oracle)) : models::AttentionHook{});
}

}  // namespace collider::testing
