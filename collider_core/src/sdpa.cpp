// Filtered backward of fused attention (DESIGN.md section 3), replacing the SDPA backward node.
// From the forward's saved Q [B, H, T, E], K, V [B, H or G, T, E] (G key/value heads under
// grouped-query attention), output O, log-sum-exp L [B, H, T] and, when the forward had one, the
// explicit mask M [B or 1, H or 1, T, T] (additive; a boolean one is saved as 0 / -inf: padding,
// the document blocks of packed rows, sliding windows, ALiBi biases):
//   kept_only:   P = exp(Q_K K_K^T s + M_KK - L_K) on kept rows and columns (causal by original
//                positions, not renormalised); dV = P^T dO; dP = dO V_K^T;
//                dS = P (dP - rowsum(dP P)); dQ = dS K_K s; dK = dS^T Q_K s.
//   exact_query: P = exp(Q_K K^T s + M_K. - L_K) over all keys; dS = P (dO V^T - rowsum(dO O_K));
//                dQ = dS K s; dK, dV computed for all keys, kept rows returned.
//   a cross-attention (keys and values another sequence [B, G, S, E], an encoder's source; token_rows.h):
//                every key is kept, so both semantics are exact_query's over all S keys, with dK, dV
//                returned whole.
// The mask is cut like the scores: kept query rows, and under kept_only kept key columns. Where
// it leaves whole key ranges out of a block of query rows (a causal mask, a sliding window, the
// other documents of a packed row), those keys are skipped, as is_causal's blocks are.
// How each runs (measured with python/bench/bench_hf_backward.py, results/bench_hf_backward):
//   exact_query on the CPU (the forward ran torch's CPU flash kernel): that kernel's own fused
//                backward on the kept queries, with an additive mask causal by original positions.
//                A mask stops the kernel skipping the blocks above the diagonal, so the kept queries
//                go in chunks, each against the keys up to its last position; dK, dV of kept keys kept.
//   kept_only on the CPU: blocked ATen GEMMs over query rows with causal block skipping
//                (kept_only_blocked below says why not the fused kernel).
//   Elsewhere (the GPU's kernels): the unfused formulas on whole
//                [B, H, N, N or T] fp32 probabilities, two GEMMs per gradient. On the CPU this was
//                0.20-0.79 of the FLOP ideal where the two paths above reach 0.9-1.0.
#include "sdpa.h"

#include <collider/collider.h>

#include <torch/csrc/autograd/generated/Functions.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

namespace collider::detail {
namespace {

namespace gen = torch::autograd::generated;
using torch::autograd::Node;
using torch::autograd::variable_list;

struct Saved {
  torch::Tensor q, k, v, out, lse;  // [B, H, T, E] x4, [B, H, T(+pad)]
  torch::Tensor mask;               // additive [B or 1, H or 1, T, T]; undefined without one
  bool causal = false;
  bool cpu_flash = false;  // saved by torch's CPU flash kernel, whose fused backward can be called
  double scale = 0;
};

// The forward's explicit mask as an additive one in `dtype` (a boolean mask becomes 0 / -inf).
torch::Tensor additive_mask(const torch::Tensor& m, c10::ScalarType dtype) {
  if (!m.defined()) return m;
  if (m.scalar_type() == torch::kBool) {
    return torch::zeros(m.sizes(), m.options().dtype(dtype)).masked_fill_(m.logical_not(), -INFINITY);
  }
  return m.to(dtype);
}

template <typename N>
Saved read_common(N* n, const NodePtr& self, const torch::Tensor& lse, const torch::Tensor& mask) {
  Saved s;
  s.q = n->query_.unpack(self);
  s.k = n->key_.unpack(self);
  s.v = n->value_.unpack(self);
  s.out = n->output_.unpack(self);
  s.lse = lse;
  s.mask = mask;
  s.causal = n->is_causal;
  s.scale = n->scale ? *n->scale : 1.0 / std::sqrt(static_cast<double>(s.q.size(-1)));
  if (s.q.dim() != 4 || s.k.dim() != 4 || s.v.dim() != 4 || s.k.size(1) == 0 || s.q.size(1) % s.k.size(1) != 0 ||
      s.v.size(1) != s.k.size(1)) {
    throw Error(
        fmt::format("collider: {} has query [{}] and key / value [{}] / [{}]: expected [B, H, T, E] "
                    "with H a multiple of the key/value heads (grouped-query attention)",
                    n->name(), fmt::join(s.q.sizes(), "x"), fmt::join(s.k.sizes(), "x"), fmt::join(s.v.sizes(), "x")));
  }
  if (s.mask.defined()) {
    const int64_t B = s.q.size(0), H = s.q.size(1), T = s.q.size(2);
    if (s.mask.dim() < 4) {  // SDPA broadcasts a [T, T] or [H, T, T] mask: the same with leading ones
      std::vector<int64_t> shape(4 - s.mask.dim(), 1);
      for (int64_t d : s.mask.sizes()) shape.push_back(d);
      s.mask = s.mask.reshape(shape);
    }
    // A padding mask over the keys alone ([B, 1, 1, T], BERT-style encoders) holds for every query row.
    if (s.mask.dim() == 4 && s.mask.size(2) == 1 && T > 1) {
      s.mask = s.mask.expand({s.mask.size(0), s.mask.size(1), T, s.mask.size(3)});
    }
    const auto& m = s.mask;
    if (m.dim() != 4 || (m.size(0) != 1 && m.size(0) != B) || (m.size(1) != 1 && m.size(1) != H) ||
        m.size(2) != T || m.size(3) != s.k.size(2)) {
      throw Error(fmt::format("collider: {} has a mask of shape [{}]; expected [B or 1, H or 1, T or 1, T] for query [{}]",
                              n->name(), fmt::join(m.sizes(), ", "), fmt::join(s.q.sizes(), ", ")));
    }
    s.mask = additive_mask(m, s.q.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat);
    // A row the mask closes entirely has no softmax; its log-sum-exp, -inf on some kernels, is taken
    // as 0 so that its probabilities come out exp(-inf) = 0, not NaN.
    s.lse = s.lse.masked_fill(s.lse.isneginf(), 0.0);
  }
  return s;
}

// The checks that need no saved tensor, and whether its tensors are behind saved-tensor hooks
// (checkpointing, offloading): then read_saved runs in the backward, where unpacking them is
// their recomputation or copy back.
template <typename N>
bool check_fused(N* n, const torch::autograd::SavedVariable& mask) {
  if (n->dropout_p != 0.0) {
    throw Error(fmt::format("collider: {} with dropout_p={} cannot be filtered (no dropout in training runs)",
                            n->name(), n->dropout_p));
  }
  return n->query_.has_hooks() || n->key_.has_hooks() || n->value_.has_hooks() || n->output_.has_hooks() ||
         mask.has_hooks();
}

// True when the node's saved tensors are behind saved-tensor hooks (read them in the backward).
bool check_saved(const NodePtr& node) {
  Node* raw = node.get();
  if (auto* n = dynamic_cast<gen::ScaledDotProductFlashAttentionForCpuBackward0*>(raw)) {
    return check_fused(n, n->attn_mask_) || n->logsumexp_.has_hooks();
  }
  if (auto* n = dynamic_cast<gen::ScaledDotProductFlashAttentionBackward0*>(raw)) {
    return check_fused(n, torch::autograd::SavedVariable()) || n->logsumexp_.has_hooks();
  }
  if (auto* n = dynamic_cast<gen::ScaledDotProductEfficientAttentionBackward0*>(raw)) {
    return check_fused(n, n->attn_bias_) || n->log_sumexp_.has_hooks();
  }
  if (auto* n = dynamic_cast<gen::ScaledDotProductCudnnAttentionBackward0*>(raw)) {
    return check_fused(n, n->attn_bias_) || n->logsumexp_.has_hooks();
  }
  throw Error(fmt::format("collider: no filtered replacement for fused attention node {}", node->name()));
}

// Whether the fused node ran with is_causal (read without unpacking its saved tensors).
bool is_causal(const NodePtr& node) {
  Node* raw = node.get();
  if (auto* n = dynamic_cast<gen::ScaledDotProductFlashAttentionForCpuBackward0*>(raw)) return n->is_causal;
  if (auto* n = dynamic_cast<gen::ScaledDotProductFlashAttentionBackward0*>(raw)) return n->is_causal;
  if (auto* n = dynamic_cast<gen::ScaledDotProductEfficientAttentionBackward0*>(raw)) return n->is_causal;
  if (auto* n = dynamic_cast<gen::ScaledDotProductCudnnAttentionBackward0*>(raw)) return n->is_causal;
  return false;
}

Saved read_saved(const NodePtr& node) {
  Node* raw = node.get();
  if (auto* n = dynamic_cast<gen::ScaledDotProductFlashAttentionForCpuBackward0*>(raw)) {
    Saved s = read_common(n, node, n->logsumexp_.unpack(node), n->attn_mask_.unpack(node));
    s.cpu_flash = s.q.device().is_cpu();
    return s;
  }
  if (auto* n = dynamic_cast<gen::ScaledDotProductFlashAttentionBackward0*>(raw)) {
    return read_common(n, node, n->logsumexp_.unpack(node), torch::Tensor());
  }
  if (auto* n = dynamic_cast<gen::ScaledDotProductEfficientAttentionBackward0*>(raw)) {
    return read_common(n, node, n->log_sumexp_.unpack(node), n->attn_bias_.unpack(node));
  }
  auto* n = dynamic_cast<gen::ScaledDotProductCudnnAttentionBackward0*>(raw);
  TORCH_CHECK(n, "collider: no filtered replacement for fused attention node ", node->name());
  return read_common(n, node, n->logsumexp_.unpack(node), n->attn_bias_.unpack(node));
}

ShapeSpec bhte_spec(int rank) {  // [B, H, T, (E)]: batch at 0, tokens at 2
  ShapeSpec s;
  s.rank = rank;
  s.dims = {DimSpec{0, DimKind::kBatch, Role::kQuery, 1}, DimSpec{2, DimKind::kToken, Role::kQuery, 1}};
  return s;
}

class FilteredAttentionNode final : public Node {
 public:
  // saved: the forward's tensors, or none when they are behind saved-tensor hooks: then they are
  // read from `fused` (the replaced node) when this node's backward runs.
  FilteredAttentionNode(std::optional<Saved> saved, NodePtr fused, std::shared_ptr<TokenIndex> ix,
                        bool exact, bool masked, bool cross)
      : s_(std::move(saved)), fused_(std::move(fused)), ix_(std::move(ix)), exact_(exact || cross), masked_(masked),
        cross_(cross) {}
  std::string name() const override {
    return exact_ ? "collider::FilteredAttentionExactQuery" : "collider::FilteredAttentionKeptOnly";
  }

  // After its backward (unless the graph is retained) the forward's tensors go, as the replaced
  // node would have let them go.
  void release_variables() override {
    s_.reset();
    fused_.reset();
  }

  variable_list apply(variable_list&& grads) override {
    torch::NoGradGuard no_grad;
    if (!s_) {
      TORCH_CHECK(fused_, "collider: the filtered attention's saved tensors were released (backward twice?)");
      s_ = read_saved(fused_);
    }
    const Saved& s = *s_;
    torch::Tensor dO = grads.at(0);
    if (masked_) dO = ix_->cut(dO, bhte_spec(4), true);  // full-size in, cut here
    const int64_t T = s.q.size(2);
    variable_list out = ix_->ragged() && !masked_ ? per_row(s, dO, T) : dispatch(*ix_, s, dO, T);
    if (masked_) {
      for (size_t i = 0; i < out.size(); ++i)
        if (i == 0 || !cross_) out[i] = scatter_full(out[i], T);  // a cross-attention's dK, dV are whole
    }
    while (out.size() < num_outputs()) out.emplace_back();
    return out;
  }

 private:
  variable_list dispatch(TokenIndex& ix, const Saved& s, const torch::Tensor& dO, int64_t T) const {
    if (!exact_ && s.q.device().is_cpu()) return kept_only_blocked(ix, s, dO, T);
    if (exact_ && s.cpu_flash) return exact_query_fused_cpu(ix, s, dO, T);
    return unfused(ix, s, dO, T);
  }

  // Ragged masks: each sequence row on its own kept count, with its own index (no padding; the
  // padded [B, H, N, N] work of the largest row is what row_attention.cpp measures for eager
  // attention), its gradients put back in the padded layout with zero padding rows.
  variable_list per_row(const Saved& s, const torch::Tensor& dO_BHNE, int64_t T) const {
    const int64_t B = ix_->B(), N = ix_->N();
    variable_list out(3);
    for (int64_t b = 0; b < B; ++b) {
      TokenIndex* row = ix_->row(b);
      if (!row) continue;  // keeps nothing: no gradient from this row
      Saved sb = s;
      for (auto* t : {&sb.q, &sb.k, &sb.v, &sb.out, &sb.lse}) *t = t->narrow(0, b, 1);
      if (sb.mask.defined() && sb.mask.size(0) > 1) sb.mask = sb.mask.narrow(0, b, 1);
      auto live = ix_->live_slots(b);
      auto g = dispatch(*row, sb, dO_BHNE.narrow(0, b, 1).index_select(2, live), T);
      for (size_t i = 0; i < 3; ++i) {
        if (!g[i].defined()) continue;
        const bool whole = cross_ && i > 0;  // a cross-attention's dK, dV: every source position
        if (!out[i].defined()) {
          out[i] = torch::zeros({B, g[i].size(1), whole ? g[i].size(2) : N, g[i].size(3)}, g[i].options());
        }
        if (whole) {
          out[i].narrow(0, b, 1).copy_(g[i]);
        } else {
          out[i].narrow(0, b, 1).index_copy_(2, live, g[i]);
        }
      }
    }
    return out;
  }

  // The mask's rows of the kept queries [B, Hm, N, T], and under cut_keys its kept key columns too
  // ([B, Hm, N, N]); s.causal adds causality by original positions. Undefined without a mask.
  static torch::Tensor cut_mask(TokenIndex& ix, const Saved& s, bool cut_keys) {
    if (!s.mask.defined()) return {};
    const int64_t B = ix.B(), N = ix.N(), Hm = s.mask.size(1), T = s.mask.size(3);
    auto m = s.mask.expand({B, Hm, s.mask.size(2), T});
    auto rows = ix.idx_BN().view({B, 1, N, 1});
    m = m.gather(2, rows.expand({B, Hm, N, T}));  // [B, Hm, N, T]
    auto cols = torch::arange(T, rows.options()).view({1, 1, 1, T});
    if (s.causal) m = m.masked_fill(cols > rows, -INFINITY);
    if (cut_keys) m = m.gather(3, ix.idx_BN().view({B, 1, 1, N}).expand({B, Hm, N, N}));
    return m;
  }

  // For each block [r0, r1) of cut query rows: the range of key columns [k0, k1) outside which the
  // cut mask is -inf in every row of the block (over the batch and heads): the keys to visit.
  static std::vector<std::pair<int64_t, int64_t>> key_ranges(const torch::Tensor& mask_BHNK, int64_t block) {
    const int64_t N = mask_BHNK.size(2), K = mask_BHNK.size(3);
    auto open_NK = (mask_BHNK > -INFINITY).flatten(0, 1).any(0);  // [N, K]
    auto cols = torch::arange(K, torch::kLong).view({1, K});
    auto first = torch::where(open_NK, cols, K).amin(1).to(torch::kCPU);               // [N]
    auto last = torch::where(open_NK, cols, -1).amax(1).to(torch::kCPU);               // [N]
    auto f = first.accessor<int64_t, 1>(), l = last.accessor<int64_t, 1>();
    std::vector<std::pair<int64_t, int64_t>> out;
    for (int64_t r0 = 0; r0 < N; r0 += block) {
      int64_t k0 = K, k1 = 0;
      for (int64_t r = r0; r < std::min(N, r0 + block); ++r) {
        k0 = std::min(k0, f[r]);
        k1 = std::max(k1, l[r] + 1);
      }
      out.emplace_back(std::min(k0, k1), k1);  // empty (k0 == k1) when every row is masked out
    }
    return out;
  }

  // exact_query: torch's CPU flash backward on the kept queries (header). dO_BHNE: their output gradient.
  variable_list exact_query_fused_cpu(TokenIndex& ix, const Saved& s, const torch::Tensor& dO_BHNE, int64_t T) const {
    const auto spec4 = bhte_spec(4), spec3 = bhte_spec(3);
    auto dO = dO_BHNE.contiguous();
    auto q = ix.cut(s.q, spec4, true).contiguous();                      // [B, H, N, E]
    auto lse = ix.cut(s.lse.narrow(2, 0, T), spec3, true).contiguous();  // [B, H, N]
    const std::optional<double> scale = s.scale;
    auto o = ix.cut(s.out, spec4, true).contiguous();
    if (s.mask.defined()) return exact_query_masked_cpu(ix, s, dO, q, o, lse);
    if (!s.causal) {
      auto [dq, dk, dv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(dO, q, s.k, s.v, o, lse, 0.0,
                                                                                   false, std::nullopt, scale);
      return {dq, key_grad(ix, dk), key_grad(ix, dv)};
    }
    // Causal by original positions needs an explicit mask, and with a mask the kernel visits
    // every key block (it skips the blocks above the diagonal only under is_causal). So the
    // kept queries go in chunks of ascending positions, each against the keys up to its last
    // position: 8 chunks visit ~56% of the [N, T] blocks instead of all of them.
    const int64_t N = ix.N(), chunks = std::clamp<int64_t>(N / 64, 1, 8);
    auto pos = ix.idx_BN().view({ix.B(), 1, N, 1});
    auto last = std::get<0>(ix.idx_BN().max(0));  // [N]: per cut row, the largest position over the batch
    auto last_acc = last.accessor<int64_t, 1>();
    auto dk = torch::zeros_like(s.k), dv = torch::zeros_like(s.v);
    std::vector<torch::Tensor> dqs;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t r0 = N * c / chunks, r1 = N * (c + 1) / chunks, keys = last_acc[r1 - 1] + 1;
      auto cols = torch::arange(keys, pos.options()).view({1, 1, 1, keys});
      auto mask = torch::zeros({ix.B(), 1, r1 - r0, keys}, q.options())
                      .masked_fill_(cols > pos.narrow(2, r0, r1 - r0),
                                    -INFINITY);  // additive, in q's dtype (what the kernel takes)
      auto [dq_c, dk_c, dv_c] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
          dO.narrow(2, r0, r1 - r0), q.narrow(2, r0, r1 - r0), s.k.narrow(2, 0, keys), s.v.narrow(2, 0, keys),
          o.narrow(2, r0, r1 - r0), lse.narrow(2, r0, r1 - r0), 0.0, false, mask, scale);
      dqs.push_back(dq_c);
      dk.narrow(2, 0, keys).add_(dk_c);
      dv.narrow(2, 0, keys).add_(dv_c);
    }
    return {chunks == 1 ? dqs[0] : torch::cat(dqs, 2), key_grad(ix, dk), key_grad(ix, dv)};
  }

  // exact_query with an explicit mask: the kernel on chunks of kept queries, each against the key
  // range its rows' mask leaves open (all keys at worst), with those rows and keys of the mask.
  variable_list exact_query_masked_cpu(TokenIndex& ix, const Saved& s, const torch::Tensor& dO, const torch::Tensor& q,
                                       const torch::Tensor& o, const torch::Tensor& lse) const {
    const int64_t N = ix.N(), chunks = std::clamp<int64_t>(N / 64, 1, 8), block = (N + chunks - 1) / chunks;
    auto mask = cut_mask(ix, s, /*cut_keys=*/false).to(q.scalar_type());  // [B, Hm, N, T], the kernel's dtype
    const std::optional<double> scale = s.scale;
    auto dk = torch::zeros_like(s.k), dv = torch::zeros_like(s.v), dq = torch::zeros_like(q);
    const auto ranges = key_ranges(mask, block);
    for (size_t c = 0; c < ranges.size(); ++c) {
      const int64_t r0 = static_cast<int64_t>(c) * block, n = std::min(block, N - r0);
      const int64_t k0 = ranges[c].first, k1 = ranges[c].second;  // not a structured binding: the lambda captures them
      if (k1 <= k0) continue;  // every row masked out: no gradient
      auto keys = [&](const torch::Tensor& t) { return t.narrow(2, k0, k1 - k0); };
      auto [dq_c, dk_c, dv_c] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
          dO.narrow(2, r0, n), q.narrow(2, r0, n), keys(s.k), keys(s.v), o.narrow(2, r0, n), lse.narrow(2, r0, n), 0.0,
          false, mask.narrow(2, r0, n).narrow(3, k0, k1 - k0), scale);
      dq.narrow(2, r0, n).copy_(dq_c);
      keys(dk).add_(dk_c);
      keys(dv).add_(dv_c);
    }
    return {dq, key_grad(ix, dk), key_grad(ix, dv)};
  }

  // kept_only on the CPU: the backward of the header's formulas in blocks of kQueryBlock cut query
  // rows, each against the keys up to its last row (causal by index is causal by original position:
  // the cut positions ascend), with the query heads that share a key/value head folded into the
  // rows of one GEMM. Probabilities exist for one block at a time ([B*G, rep*n, keys], in cache).
  // Five GEMMs per block, the flash backward's count; torch's fused kernel cannot be called here,
  // because the kept_only correction rowsum(dP P) needs the restricted output P V_K, which only a
  // second (forward) kernel call gives: that added 2 of 5 GEMMs (measured: 0.83-0.89 of the FLOP
  // ideal at T 1024 against 0.92-1.05 with this). Ragged masks: padding keys' probabilities
  // are zeroed, so they neither give nor receive gradient.
  static constexpr int64_t kQueryBlock = 64;

  // exact_query's dK / dV over all T keys cut to the kept ones: dropped keys' gradients discarded,
  // ragged rows' padding (dropped tokens too) included. A padding query row needs no care: its dO is
  // zero (ZeroPadding where gradients are born), so it adds nothing to any gradient.
  static torch::Tensor kept_keys(TokenIndex& ix, const torch::Tensor& g_BGTE) {
    const auto spec4 = bhte_spec(4);
    return ix.zero_padding_into(ix.cut(g_BGTE, spec4, true), g_BGTE, spec4, false);
  }
  // exact_query's dK / dV as returned: cut to the kept keys, or whole for a cross-attention ([B, G, S, E]).
  torch::Tensor key_grad(TokenIndex& ix, const torch::Tensor& g_BGTE) const {
    return cross_ ? g_BGTE : kept_keys(ix, g_BGTE);
  }
  variable_list kept_only_blocked(TokenIndex& ix, const Saved& s, const torch::Tensor& dO_BHNE, int64_t T) const {
    const auto spec4 = bhte_spec(4), spec3 = bhte_spec(3);
    const int64_t B = ix.B(), N = ix.N(), H = s.q.size(1), G = s.k.size(1), rep = H / G, E = s.q.size(3);
    const auto dtype = s.q.scalar_type();
    const auto acc = dtype == torch::kDouble ? torch::kDouble : torch::kFloat;
    // [B, G, rep, N, E]: query head h = g * rep + r reads key/value head g (SDPA's enable_gqa)
    auto q = ix.cut(s.q, spec4, true).to(acc).view({B, G, rep, N, E});
    auto dO = dO_BHNE.to(acc).reshape({B, G, rep, N, E});
    auto lse = ix.cut(s.lse.narrow(2, 0, T), spec3, true).to(acc).view({B, G, rep, N});
    auto k = ix.cut(s.k, spec4, true).to(acc).reshape({B * G, N, E});
    auto v = ix.cut(s.v, spec4, true).to(acc).reshape({B * G, N, E});
    torch::Tensor pad_keys;  // [B * G, 1, N]
    if (ix.ragged()) pad_keys = ix.pad_BN().view({B, 1, 1, N}).expand({B, G, 1, N}).reshape({B * G, 1, N});
    // An explicit mask, cut to kept rows and columns ([B, Hm, N, N]; its causality included): added
    // to the scores, and the keys it leaves out of a block are skipped.
    auto mask = cut_mask(ix, s, /*cut_keys=*/true);
    if (mask.defined()) mask = mask.to(acc);
    const int64_t Hm = mask.defined() ? mask.size(1) : 1;
    const auto ranges = mask.defined() ? key_ranges(mask, kQueryBlock) : std::vector<std::pair<int64_t, int64_t>>();
    auto dq = torch::zeros({B, G, rep, N, E}, q.options());
    auto dk = torch::zeros({B * G, N, E}, q.options()), dv = torch::zeros({B * G, N, E}, q.options());
    for (int64_t r0 = 0; r0 < N; r0 += kQueryBlock) {
      const int64_t n = std::min(kQueryBlock, N - r0);
      int64_t k0 = 0, k1 = s.causal ? r0 + n : N;
      if (mask.defined()) std::tie(k0, k1) = ranges[r0 / kQueryBlock];
      if (k1 <= k0) continue;  // every row masked out: no gradient
      const int64_t keys = k1 - k0;
      auto rows = [&](const torch::Tensor& t) { return t.narrow(3, r0, n).reshape({B * G, rep * n, E}); };
      auto Qb = rows(q), dOb = rows(dO);
      auto Kb = k.narrow(1, k0, keys), Vb = v.narrow(1, k0, keys);
      auto Lb = lse.narrow(3, r0, n).reshape({B * G, rep * n, 1});
      auto p = at::baddbmm(Lb, Qb, Kb.transpose(1, 2), -1.0, s.scale);  // [B*G, rep*n, keys]: S - L
      if (mask.defined()) {  // query head h = g * rep + r; a mask of one head serves all
        auto mb = mask.narrow(2, r0, n).narrow(3, k0, keys);
        p.view({B, G, rep, n, keys}).add_(Hm == 1 ? mb.view({B, 1, 1, n, keys}) : mb.view({B, G, rep, n, keys}));
      }
      p.exp_();
      if (s.causal && !mask.defined()) {  // the diagonal block: cut row r0 + i sees keys up to r0 + i
        auto above = torch::ones({n, n}, p.options().dtype(torch::kBool)).triu_(1);
        p.view({B * G, rep, n, keys}).narrow(3, r0, n).masked_fill_(above, 0.0);
      }
      if (pad_keys.defined()) p.masked_fill_(pad_keys.narrow(2, k0, keys), 0.0);
      dv.narrow(1, k0, keys).baddbmm_(p.transpose(1, 2), dOb);
      auto ds = at::bmm(dOb, Vb.transpose(1, 2));  // dP, then dS = P (dP - rowsum(dP P)) in place
      auto d = (ds * p).sum(-1, true);
      ds.sub_(d).mul_(p);
      dq.narrow(3, r0, n).copy_(at::bmm(ds, Kb).mul_(s.scale).view({B, G, rep, n, E}));
      dk.narrow(1, k0, keys).baddbmm_(ds.transpose(1, 2), Qb, 1.0, s.scale);
    }
    return {dq.view({B, H, N, E}).to(dtype), dk.view({B, G, N, E}).to(dtype), dv.view({B, G, N, E}).to(dtype)};
  }

  variable_list unfused(TokenIndex& ix, const Saved& s, const torch::Tensor& dO, int64_t T) const {
    const auto spec4 = bhte_spec(4), spec3 = bhte_spec(3);
    const auto dtype = s.q.scalar_type();
    const auto f32 = [](const torch::Tensor& t) { return t.to(torch::kFloat); };
    auto q = f32(ix.cut(s.q, spec4, true));
    auto lse = f32(ix.cut(s.lse.narrow(2, 0, T), spec3, true)).unsqueeze(-1);  // [B, H, N, 1]
    auto dOf = f32(dO);
    auto pos = ix.idx_BN().view({ix.B(), 1, ix.N(), 1});  // [B, 1, N, 1]: original positions
    // Grouped-query attention (SDPA's enable_gqa): K and V carry G = H / rep heads; query head h
    // reads kv head h / rep. They are repeated to H heads here and their gradients summed back.
    const int64_t H = s.q.size(1), G = s.k.size(1), rep = H / G;
    auto to_heads = [&](const torch::Tensor& t) { return rep == 1 ? t : t.repeat_interleave(rep, 1); };
    auto to_groups = [&](const torch::Tensor& g_BHTE) {
      if (rep == 1) return g_BHTE;
      return g_BHTE.view({g_BHTE.size(0), G, rep, g_BHTE.size(2), g_BHTE.size(3)}).sum(2);
    };
    torch::Tensor dq, dk, dv;
    if (!exact_) {
      auto k = to_heads(f32(ix.cut(s.k, spec4, true))), v = to_heads(f32(ix.cut(s.v, spec4, true)));
      auto scores = q.matmul(k.transpose(-2, -1)) * s.scale - lse;  // [B, H, N, N]
      if (auto m = cut_mask(ix, s, /*cut_keys=*/true); m.defined()) scores.add_(f32(m));
      auto p = scores.exp_();
      if (s.causal) p.masked_fill_(pos.transpose(-2, -1) > pos, 0.0);
      if (ix.ragged()) p.masked_fill_(ix.pad_BN().view({ix.B(), 1, 1, ix.N()}), 0.0);  // padding keys
      dv = p.transpose(-2, -1).matmul(dOf);
      auto dp = dOf.matmul(v.transpose(-2, -1));
      auto ds = p * (dp - (dp * p).sum(-1, true));
      dq = ds.matmul(k) * s.scale;
      dk = to_groups(ds.transpose(-2, -1).matmul(q) * s.scale);
      dv = to_groups(dv);
    } else {
      auto k = to_heads(f32(s.k)), v = to_heads(f32(s.v));
      auto o = f32(ix.cut(s.out, spec4, true));
      auto scores = q.matmul(k.transpose(-2, -1)) * s.scale - lse;  // [B, H, N, T]
      if (auto m = cut_mask(ix, s, /*cut_keys=*/false); m.defined()) scores.add_(f32(m));
      auto p = scores.exp_();
      if (s.causal) {
        auto cols = torch::arange(T, pos.options()).view({1, 1, 1, T});
        p.masked_fill_(cols > pos, 0.0);
      }
      auto d = (dOf * o).sum(-1, true);  // rowsum(dO O): the exact softmax correction
      auto ds = p * (dOf.matmul(v.transpose(-2, -1)) - d);
      dq = ds.matmul(k) * s.scale;
      // dropped keys' gradients discarded, padding rows (dropped tokens too) included
      dk = key_grad(ix, to_groups(ds.transpose(-2, -1).matmul(q) * s.scale));
      dv = key_grad(ix, to_groups(p.transpose(-2, -1).matmul(dOf)));
    }
    return {dq.to(dtype), dk.to(dtype), dv.to(dtype)};
  }

  torch::Tensor scatter_full(const torch::Tensor& g_BHNE, int64_t T) const {
    auto full = torch::zeros({g_BHNE.size(0), g_BHNE.size(1), T, g_BHNE.size(3)}, g_BHNE.options());
    auto idx = ix_->idx_BN().view({ix_->B(), 1, ix_->N(), 1}).expand_as(g_BHNE);
    return full.scatter_(2, idx, g_BHNE);
  }
  std::optional<Saved> s_;
  NodePtr fused_;
  std::shared_ptr<TokenIndex> ix_;
  bool exact_, masked_, cross_;
};

}  // namespace

NodePtr make_filtered_attention(const NodePtr& fused, std::shared_ptr<TokenIndex> index, bool exact_query, bool masked,
                                bool cross) {
  const bool hooked = check_saved(fused);
  std::optional<Saved> saved;
  if (!hooked) saved = read_saved(fused);
  const auto& meta = fused->input_metadata(0);  // the output O: [B, H, T, E]
  auto shape = meta.shape_as_dim_vector().vec();
  if (!masked) shape[2] = index->N();
  if (cross && is_causal(fused)) {
    throw Error(fmt::format("collider cannot filter node {}: a causal attention onto another sequence (a "
                            "cross-attention with is_causal=True); pass the mask it means as attn_mask",
                            fused->name()));
  }
  auto node = make_node<FilteredAttentionNode>(std::move(saved), hooked ? fused : nullptr, index, exact_query, masked,
                                               cross);
  node->add_input_metadata(meta.options(), shape, false, false, std::nullopt);
  for (uint32_t i = 1; i < fused->num_inputs(); ++i) {
    node->add_input_metadata(torch::autograd::Node::undefined_input());  // logsumexp etc.: no gradient
  }
  for (const auto& e : fused->next_edges()) node->add_next_edge(e);
  return node;
}

}  // namespace collider::detail
