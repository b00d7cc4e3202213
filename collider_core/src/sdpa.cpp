// Filtered backward of fused attention (DESIGN.md section 3), replacing the SDPA backward node.
// From the forward's saved Q [B, H, T, E], K, V [B, H or G, T, E] (G key/value heads under
// grouped-query attention), output O and log-sum-exp L [B, H, T]:
//   kept_only:   P = exp(Q_K K_K^T s - L_K) on kept rows and columns (causal by original
//                positions, not renormalised); dV = P^T dO; dP = dO V_K^T;
//                dS = P (dP - rowsum(dP P)); dQ = dS K_K s; dK = dS^T Q_K s.
//   exact_query: P = exp(Q_K K^T s - L_K) over all keys; dS = P (dO V^T - rowsum(dO O_K));
//                dQ = dS K s; dK, dV computed for all keys, kept rows returned.
// On the CPU (the forward ran torch's flash kernel for the CPU) both semantics call that kernel's
// own fused backward on the cut tensors, so Collider's attention backward is the same kernel as the
// regular one on fewer rows:
//   exact_query: backward(dO_K, Q_K, K, V, O_K, L_K) with an additive mask [B, 1, N, T] that is causal
//                by original positions; dK, dV of the kept keys are kept.
//   kept_only:   the restricted output O' = P V_K (not renormalised) is what the backward's
//                rowsum(dO O') needs. The fused forward on the cut rows gives the renormalised O''
//                and its log-sum-exp L''; O' = O'' exp(L'' - L_K). Then backward(dO_K, Q_K, K_K, V_K,
//                O', L_K), causal on the cut rows (kept positions are ascending, so causal by original
//                positions is causal by index). The forward adds 2 of the backward's 5 GEMMs; the
//                unfused path it replaces materialised [B, H, N, N] fp32 probabilities and ran
//                4-5x slower than the regular backward per row (results/bench_hf_backward).
// Ragged masks (padding rows, which can have no key to attend under kept_only) and the GPU's
// kernels take the unfused path: plain ATen ops, two GEMMs per gradient.
#include "sdpa.h"

#include <collider/collider.h>

#include <torch/csrc/autograd/generated/Functions.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>

namespace collider::detail {
namespace {

namespace gen = torch::autograd::generated;
using torch::autograd::Node;
using torch::autograd::variable_list;

struct Saved {
  torch::Tensor q, k, v, out, lse;  // [B, H, T, E] x4, [B, H, T(+pad)]
  bool causal = false;
  bool cpu_flash = false;  // saved by torch's CPU flash kernel, whose fused backward can be called
  double scale = 0;
};

template <typename N>
Saved read_common(N* n, const std::shared_ptr<Node>& self, const torch::Tensor& lse) {
  Saved s;
  s.q = n->query_.unpack(self);
  s.k = n->key_.unpack(self);
  s.v = n->value_.unpack(self);
  s.out = n->output_.unpack(self);
  s.lse = lse;
  s.causal = n->is_causal;
  s.scale = n->scale ? *n->scale : 1.0 / std::sqrt(static_cast<double>(s.q.size(-1)));
  if (s.q.dim() != 4 || s.k.dim() != 4 || s.v.dim() != 4 || s.k.size(1) == 0 || s.q.size(1) % s.k.size(1) != 0 ||
      s.v.size(1) != s.k.size(1)) {
    throw Error(fmt::format("collider: {} has query [{}] and key / value [{}] / [{}]: expected [B, H, T, E] "
                            "with H a multiple of the key/value heads (grouped-query attention)",
                            n->name(), fmt::join(s.q.sizes(), "x"), fmt::join(s.k.sizes(), "x"),
                            fmt::join(s.v.sizes(), "x")));
  }
  if (n->dropout_p != 0.0) {
    throw Error(fmt::format("collider: {} with dropout_p={} cannot be filtered (no dropout in training runs)",
                            n->name(), n->dropout_p));
  }
  return s;
}

Saved read_saved(const std::shared_ptr<Node>& node) {
  Node* raw = node.get();
  if (auto* n = dynamic_cast<gen::ScaledDotProductFlashAttentionForCpuBackward0*>(raw)) {
    if (n->attn_mask_.unpack(node).defined()) throw Error("collider: fused attention with an explicit mask is not supported; use is_causal");
    Saved s = read_common(n, node, n->logsumexp_.unpack(node));
    s.cpu_flash = s.q.device().is_cpu();
    return s;
  }
  if (auto* n = dynamic_cast<gen::ScaledDotProductFlashAttentionBackward0*>(raw)) {
    return read_common(n, node, n->logsumexp_.unpack(node));
  }
  if (auto* n = dynamic_cast<gen::ScaledDotProductEfficientAttentionBackward0*>(raw)) {
    if (n->attn_bias_.unpack(node).defined()) throw Error("collider: fused attention with an explicit bias is not supported; use is_causal");
    return read_common(n, node, n->log_sumexp_.unpack(node));
  }
  if (auto* n = dynamic_cast<gen::ScaledDotProductCudnnAttentionBackward0*>(raw)) {
    if (n->attn_bias_.unpack(node).defined()) throw Error("collider: fused attention with an explicit bias is not supported; use is_causal");
    return read_common(n, node, n->logsumexp_.unpack(node));
  }
  throw Error(fmt::format("collider: no filtered replacement for fused attention node {}", node->name()));
}

ShapeSpec bhte_spec(int rank) {  // [B, H, T, (E)]: batch at 0, tokens at 2
  ShapeSpec s;
  s.rank = rank;
  s.dims = {DimSpec{0, DimKind::kBatch, Role::kQuery, 1}, DimSpec{2, DimKind::kToken, Role::kQuery, 1}};
  return s;
}

class FilteredAttentionNode final : public Node {
 public:
  FilteredAttentionNode(Saved saved, std::shared_ptr<TokenIndex> ix, bool exact, bool masked)
      : s_(std::move(saved)), ix_(std::move(ix)), exact_(exact), masked_(masked) {}
  std::string name() const override { return exact_ ? "collider::FilteredAttentionExactQuery" : "collider::FilteredAttentionKeptOnly"; }

  variable_list apply(variable_list&& grads) override {
    torch::NoGradGuard no_grad;
    const auto spec4 = bhte_spec(4), spec3 = bhte_spec(3);
    torch::Tensor dO = grads.at(0);
    if (masked_) dO = ix_->cut(dO, spec4, true);  // full-size in, cut here
    const int64_t T = s_.q.size(2);
    variable_list out = s_.cpu_flash && !ix_->ragged() ? fused_cpu(dO, T) : unfused(dO, T);
    if (masked_) {
      for (auto& g : out) g = scatter_full(g, T);
    }
    while (out.size() < num_outputs()) out.emplace_back();
    return out;
  }

 private:
  // torch's CPU flash backward on the cut rows (header). dO_BHNE: the kept rows' output gradient.
  variable_list fused_cpu(const torch::Tensor& dO_BHNE, int64_t T) const {
    const auto spec4 = bhte_spec(4), spec3 = bhte_spec(3);
    auto dO = dO_BHNE.contiguous();
    auto q = ix_->cut(s_.q, spec4, true).contiguous();                        // [B, H, N, E]
    auto lse = ix_->cut(s_.lse.narrow(2, 0, T), spec3, true).contiguous();   // [B, H, N]
    const std::optional<double> scale = s_.scale;
    if (exact_) {
      std::optional<torch::Tensor> mask;
      if (s_.causal) {  // additive, in the query's dtype (what the kernel takes): key t visible iff t <= pos
        auto pos = ix_->idx_BN().view({ix_->B(), 1, ix_->N(), 1});
        auto cols = torch::arange(T, pos.options()).view({1, 1, 1, T});
        mask = torch::zeros({ix_->B(), 1, ix_->N(), T}, q.options()).masked_fill_(cols > pos, -INFINITY);
      }
      auto o = ix_->cut(s_.out, spec4, true).contiguous();
      auto [dq, dk, dv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
          dO, q, s_.k, s_.v, o, lse, 0.0, false, mask, scale);
      return {dq, ix_->cut(dk, spec4, true), ix_->cut(dv, spec4, true)};  // dropped keys' gradients discarded
    }
    auto k = ix_->cut(s_.k, spec4, true).contiguous(), v = ix_->cut(s_.v, spec4, true).contiguous();
    auto [o2, lse2] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, s_.causal, std::nullopt, scale);
    auto o = (o2 * (lse2 - lse).exp().unsqueeze(-1).to(o2.scalar_type())).contiguous();  // O' = O'' exp(L'' - L_K)
    auto [dq, dk, dv] =
        at::_scaled_dot_product_flash_attention_for_cpu_backward(dO, q, k, v, o, lse, 0.0, s_.causal, std::nullopt, scale);
    return {dq, dk, dv};
  }

  variable_list unfused(const torch::Tensor& dO, int64_t T) const {
    const auto spec4 = bhte_spec(4), spec3 = bhte_spec(3);
    const auto dtype = s_.q.scalar_type();
    const auto f32 = [](const torch::Tensor& t) { return t.to(torch::kFloat); };
    auto q = f32(ix_->cut(s_.q, spec4, true));
    auto lse = f32(ix_->cut(s_.lse.narrow(2, 0, T), spec3, true)).unsqueeze(-1);  // [B, H, N, 1]
    auto dOf = f32(dO);
    auto pos = ix_->idx_BN().view({ix_->B(), 1, ix_->N(), 1});  // [B, 1, N, 1]: original positions
    // Grouped-query attention (SDPA's enable_gqa): K and V carry G = H / rep heads; query head h
    // reads kv head h / rep. They are repeated to H heads here and their gradients summed back.
    const int64_t H = s_.q.size(1), G = s_.k.size(1), rep = H / G;
    auto to_heads = [&](const torch::Tensor& t) { return rep == 1 ? t : t.repeat_interleave(rep, 1); };
    auto to_groups = [&](const torch::Tensor& g_BHTE) {
      if (rep == 1) return g_BHTE;
      return g_BHTE.view({g_BHTE.size(0), G, rep, g_BHTE.size(2), g_BHTE.size(3)}).sum(2);
    };
    torch::Tensor dq, dk, dv;
    if (!exact_) {
      auto k = to_heads(f32(ix_->cut(s_.k, spec4, true))), v = to_heads(f32(ix_->cut(s_.v, spec4, true)));
      auto p = (q.matmul(k.transpose(-2, -1)) * s_.scale - lse).exp_();  // [B, H, N, N]
      if (s_.causal) p.masked_fill_(pos.transpose(-2, -1) > pos, 0.0);
      if (ix_->ragged()) p.masked_fill_(ix_->pad_BN().view({ix_->B(), 1, 1, ix_->N()}), 0.0);  // padding keys
      dv = p.transpose(-2, -1).matmul(dOf);
      auto dp = dOf.matmul(v.transpose(-2, -1));
      auto ds = p * (dp - (dp * p).sum(-1, true));
      dq = ds.matmul(k) * s_.scale;
      dk = to_groups(ds.transpose(-2, -1).matmul(q) * s_.scale);
      dv = to_groups(dv);
    } else {
      auto k = to_heads(f32(s_.k)), v = to_heads(f32(s_.v));
      auto o = f32(ix_->cut(s_.out, spec4, true));
      auto p = (q.matmul(k.transpose(-2, -1)) * s_.scale - lse).exp_();  // [B, H, N, T]
      if (s_.causal) {
        auto cols = torch::arange(T, pos.options()).view({1, 1, 1, T});
        p.masked_fill_(cols > pos, 0.0);
      }
      auto d = (dOf * o).sum(-1, true);  // rowsum(dO O): the exact softmax correction
      auto ds = p * (dOf.matmul(v.transpose(-2, -1)) - d);
      dq = ds.matmul(k) * s_.scale;
      // dropped keys' gradients discarded, padding rows (dropped tokens too) included
      dk = ix_->zero_padding(ix_->cut(to_groups(ds.transpose(-2, -1).matmul(q) * s_.scale), spec4, true), spec4, false);
      dv = ix_->zero_padding(ix_->cut(to_groups(p.transpose(-2, -1).matmul(dOf)), spec4, true), spec4, false);
    }
    return {dq.to(dtype), dk.to(dtype), dv.to(dtype)};
  }

  torch::Tensor scatter_full(const torch::Tensor& g_BHNE, int64_t T) const {
    auto full = torch::zeros({g_BHNE.size(0), g_BHNE.size(1), T, g_BHNE.size(3)}, g_BHNE.options());
    auto idx = ix_->idx_BN().view({ix_->B(), 1, ix_->N(), 1}).expand_as(g_BHNE);
    return full.scatter_(2, idx, g_BHNE);
  }
  Saved s_;
  std::shared_ptr<TokenIndex> ix_;
  bool exact_, masked_;
};

}  // namespace

bool is_fused_attention_node(const std::string& type) {
  return type == "ScaledDotProductFlashAttentionForCpuBackward0" || type == "ScaledDotProductFlashAttentionBackward0" ||
         type == "ScaledDotProductEfficientAttentionBackward0" || type == "ScaledDotProductCudnnAttentionBackward0";
}

std::shared_ptr<Node> make_filtered_attention(const std::shared_ptr<Node>& fused, std::shared_ptr<TokenIndex> index,
                                              bool exact_query, bool masked) {
  Saved saved = read_saved(fused);
  const auto& meta = fused->input_metadata(0);  // the output O: [B, H, T, E]
  auto shape = meta.shape_as_dim_vector().vec();
  if (!masked) shape[2] = index->N();
  auto node = std::make_shared<FilteredAttentionNode>(std::move(saved), index, exact_query, masked);
  node->add_input_metadata(meta.options(), shape, false, false, std::nullopt);
  for (uint32_t i = 1; i < fused->num_inputs(); ++i) {
    node->add_input_metadata(torch::autograd::Node::undefined_input());  // logsumexp etc.: no gradient
  }
  for (const auto& e : fused->next_edges()) node->add_next_edge(e);
  return node;
}

}  // namespace collider::detail
