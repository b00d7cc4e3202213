// The fused LM head (include/collider/head.h): every row scored in blocks of rows and vocabulary
// with an online log-sum-exp, the kept rows' logits recomputed block by block in the backward.
// Legend: N rows, D hidden, V vocabulary, K contributing rows, R rows of a block, C its
// vocabulary columns.
#include "head_node.h"

#include <collider/error.h>
#include <collider/torch_compat.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <algorithm>
#include <limits>

namespace collider {
namespace detail {
namespace {

// The head runs in its inputs' dtype, forward and backward alike: autocast (active in the forward,
// not in the backward) would otherwise score with other logits than the backward recomputes.
struct NoAutocast {
  c10::impl::ExcludeDispatchKeyGuard guard{c10::autocast_dispatch_keyset};
};

// The accumulation dtype: float64 for float64 inputs, float32 otherwise.
c10::ScalarType accumulation(c10::ScalarType t) {
  return t == c10::ScalarType::Double ? c10::ScalarType::Double : c10::ScalarType::Float;
}

// One block of logits z = softcap(scale * (x W[c0:c0+C]^T + b[c0:c0+C])), in the accumulation
// dtype. x_RD: the block's rows.
torch::Tensor logits_block(const torch::Tensor& x_RD, const torch::Tensor& weight_VD, const torch::Tensor& bias_V,
                           int64_t c0, int64_t C, const HeadOptions& o) {
  const torch::Tensor w_CD = weight_VD.narrow(0, c0, C);
  torch::Tensor lin_RC =
      bias_V.defined() ? at::addmm(bias_V.narrow(0, c0, C), x_RD, w_CD.t()) : at::mm(x_RD, w_CD.t());
  torch::Tensor z_RC = lin_RC.to(accumulation(lin_RC.scalar_type()));
  if (o.logit_scale != 1.0) z_RC.mul_(o.logit_scale);
  if (o.softcap > 0.0) z_RC.div_(o.softcap).tanh_().mul_(o.softcap);
  return z_RC;
}

// The block's column of each row's target (clamped into the block) and whether it lies there.
std::pair<torch::Tensor, torch::Tensor> target_in_block(const torch::Tensor& target_R, int64_t c0, int64_t C) {
  torch::Tensor in_R = target_R.ge(c0).logical_and_(target_R.lt(c0 + C));
  return {(target_R - c0).clamp_(0, C - 1), in_R};
}

}  // namespace
}  // namespace detail

ScoredHead score_head(const torch::Tensor& hidden, const torch::Tensor& weight, const torch::Tensor& targets,
                      const HeadOptions& o, const torch::Tensor& bias) {
  detail::check_head_arguments("collider::score_head", hidden, weight, targets, torch::Tensor(), o, bias);
  const int64_t D = weight.size(1), V = weight.size(0);
  const auto acc = detail::accumulation(hidden.scalar_type());
  torch::NoGradGuard no_grad;
  const detail::NoAutocast no_autocast;
  const torch::Tensor x_ND = hidden.detach().reshape({-1, D});
  const torch::Tensor target_N = targets.reshape({-1});
  const int64_t N = x_ND.size(0);
  torch::Tensor lse_N = torch::empty({N}, x_ND.options().dtype(acc));
  torch::Tensor zt_N = torch::zeros({N}, x_ND.options().dtype(acc));
  torch::Tensor entropy_N = o.entropy ? torch::empty({N}, x_ND.options().dtype(acc)) : torch::Tensor();
  const torch::Tensor w = weight.detach(), b = bias.defined() ? bias.detach() : torch::Tensor();
  for (int64_t r0 = 0; r0 < N; r0 += o.chunk_rows) {
    const int64_t R = std::min(o.chunk_rows, N - r0);
    const torch::Tensor x_RD = x_ND.narrow(0, r0, R), target_R = target_N.narrow(0, r0, R);
    // Running maximum m, sum of exp(z - m) s, and (entropy) sum of exp(z - m) z a, per row.
    torch::Tensor m_R = torch::full({R}, -std::numeric_limits<double>::infinity(), lse_N.options());
    torch::Tensor s_R = torch::zeros({R}, lse_N.options());
    torch::Tensor a_R = o.entropy ? torch::zeros({R}, lse_N.options()) : torch::Tensor();
    torch::Tensor zt_R = zt_N.narrow(0, r0, R);
    for (int64_t c0 = 0; c0 < V; c0 += o.chunk_vocab) {
      const int64_t C = std::min(o.chunk_vocab, V - c0);
      const torch::Tensor z_RC = detail::logits_block(x_RD, w, b, c0, C, o);
      const torch::Tensor m_new_R = torch::maximum(m_R, std::get<0>(z_RC.max(1)));
      const torch::Tensor rescale_R = (m_R - m_new_R).exp_();
      const torch::Tensor e_RC = (z_RC - m_new_R.unsqueeze(1)).exp_();
      s_R.mul_(rescale_R).add_(e_RC.sum(1));
      if (o.entropy) a_R.mul_(rescale_R).add_((e_RC * z_RC).sum(1));
      m_R = m_new_R;
      auto [col_R, in_R] = detail::target_in_block(target_R, c0, C);
      zt_R.add_(z_RC.gather(1, col_R.unsqueeze(1)).squeeze(1).mul_(in_R));
    }
    lse_N.narrow(0, r0, R).copy_(m_R + s_R.log());
    if (o.entropy) entropy_N.narrow(0, r0, R).copy_(lse_N.narrow(0, r0, R) - a_R / s_R);
  }
  ScoredHead out;
  out.token_loss = (lse_N - zt_N).mul_(target_N.ne(o.ignore_index)).view(targets.sizes());
  if (o.entropy) out.entropy = entropy_N.view(targets.sizes());
  out.hidden_ = hidden;
  out.weight_ = weight;
  out.bias_ = bias;
  out.targets_ = targets;
  out.lse_ = lse_N;
  out.opts_ = o;
  return out;
}

torch::Tensor ScoredHead::loss(const torch::Tensor& keep, double divisor) const {
  const char* who = "collider::ScoredHead::loss";
  if (!hidden_.defined()) throw Error(fmt::format("{}: this ScoredHead was not made by score_head", who));
  if (keep.defined() && (keep.sizes() != targets_.sizes() || keep.scalar_type() != c10::ScalarType::Bool)) {
    throw Error(fmt::format("{}: keep must be bool [{}] (the targets' shape); got {} [{}]", who,
                            fmt::join(targets_.sizes(), ", "), c10::toString(keep.scalar_type()),
                            fmt::join(keep.sizes(), ", ")));
  }
  if (!(divisor > 0.0)) throw Error(fmt::format("{}: divisor must be > 0; got {}", who, divisor));
  const int64_t D = weight_.size(1);
  const bool wants_grad = torch::GradMode::is_enabled() &&
                          (hidden_.requires_grad() || weight_.requires_grad() ||
                           (bias_.defined() && bias_.requires_grad()));
  torch::NoGradGuard no_grad;
  const torch::Tensor keep_N =
      keep.defined() ? keep.reshape({-1}) : torch::ones({targets_.numel()}, targets_.options().dtype(torch::kBool));
  const torch::Tensor target_N = targets_.reshape({-1});
  const torch::Tensor counted_N = target_N.ne(opts_.ignore_index).logical_and_(keep_N);
  torch::Tensor loss = (token_loss.reshape({-1}) * counted_N).sum() / divisor;
  if (!wants_grad) return loss;
  detail::FusedHeadNode::Saved s;
  s.opts = opts_;
  s.divisor = divisor;
  s.rows_K = counted_N.nonzero().squeeze(1);
  s.hidden_KD = hidden_.detach().reshape({-1, D}).index_select(0, s.rows_K);
  s.lse_K = lse_.index_select(0, s.rows_K);
  s.target_K = target_N.index_select(0, s.rows_K);
  s.keep = keep.defined() ? keep : keep_N.view(targets_.sizes());
  s.weight_VD = weight_.detach();
  if (bias_.defined()) s.bias_V = bias_.detach();
  s.hidden_sizes = hidden_.sizes().vec();
  s.hidden_dtype = hidden_.scalar_type();
  auto node = make_node<detail::FusedHeadNode>(std::move(s));
  node->set_next_edges(torch::autograd::collect_next_edges(hidden_, weight_, bias_));
  const uint32_t input_nr = node->add_input_metadata(loss);
  torch::autograd::impl::set_gradient_edge(loss, torch::autograd::Edge(NodePtr(node), input_nr));
  return loss;
}

namespace detail {

FusedHeadNode::FusedHeadNode(Saved saved)
    : s_(std::move(saved)),
      weight_version_(s_.weight_VD._version()),
      bias_version_(s_.bias_V.defined() ? s_.bias_V._version() : 0) {}

void FusedHeadNode::release_variables() {
  s_.hidden_KD = s_.lse_K = s_.target_K = s_.weight_VD = s_.bias_V = torch::Tensor();
  released_ = true;
}

torch::autograd::variable_list FusedHeadNode::apply(torch::autograd::variable_list&& grads) {
  torch::NoGradGuard no_grad;
  const NoAutocast no_autocast;
  if (released_) {
    throw Error(
        "collider::fused_head_loss: its backward ran a second time, after its saved rows were freed; pass "
        "retain_graph=True to the first backward");
  }
  if (s_.weight_VD._version() != weight_version_ || (s_.bias_V.defined() && s_.bias_V._version() != bias_version_)) {
    throw Error(
        "collider::fused_head_loss: the head's weight (or bias) was modified in place between the forward and "
        "the backward; step the optimizer after loss.backward()");
  }
  const HeadOptions& o = s_.opts;
  const torch::Tensor& w_VD = s_.weight_VD;
  const int64_t V = w_VD.size(0), D = w_VD.size(1), K = s_.hidden_KD.size(0);
  const auto acc = s_.lse_K.scalar_type();
  const bool want_hidden = should_compute_output(0), want_weight = should_compute_output(1),
             want_bias = s_.bias_V.defined() && should_compute_output(2);
  torch::Tensor d_hidden_KD, d_weight_VD, d_bias_V;
  if (want_hidden) d_hidden_KD = torch::zeros({K, D}, s_.lse_K.options());
  if (want_weight) d_weight_VD = torch::zeros_like(w_VD, at::MemoryFormat::Contiguous);
  if (want_bias) d_bias_V = torch::zeros_like(s_.bias_V, at::MemoryFormat::Contiguous);
  const torch::Tensor& upstream = grads.at(0);
  if (K > 0 && upstream.defined()) {
    const torch::Tensor coef = upstream.to(acc) / s_.divisor;  // d(loss) / d(score) of every counted row
    for (int64_t c0 = 0; c0 < V; c0 += o.chunk_vocab) {
      const int64_t C = std::min(o.chunk_vocab, V - c0);
      const torch::Tensor w_CD = w_VD.narrow(0, c0, C);
      torch::Tensor d_weight_CD = want_weight ? torch::zeros({C, D}, s_.lse_K.options()) : torch::Tensor();
      for (int64_t r0 = 0; r0 < K; r0 += o.chunk_rows) {
        const int64_t R = std::min(o.chunk_rows, K - r0);
        const torch::Tensor x_RD = s_.hidden_KD.narrow(0, r0, R);
        const torch::Tensor z_RC = logits_block(x_RD, w_VD, s_.bias_V, c0, C, o);
        torch::Tensor dz_RC = (z_RC - s_.lse_K.narrow(0, r0, R).unsqueeze(1)).exp_();  // softmax
        auto [col_R, in_R] = target_in_block(s_.target_K.narrow(0, r0, R), c0, C);
        dz_RC.scatter_add_(1, col_R.unsqueeze(1), in_R.to(acc).neg_().unsqueeze(1));  // - onehot(target)
        dz_RC.mul_(coef);
        if (o.softcap > 0.0) dz_RC.mul_(1.0 - (z_RC / o.softcap).square_());  // d(c tanh(u / c)) / du
        if (o.logit_scale != 1.0) dz_RC.mul_(o.logit_scale);
        const torch::Tensor dlin_RC = dz_RC.to(s_.hidden_dtype);
        if (want_hidden) d_hidden_KD.narrow(0, r0, R).add_(at::mm(dlin_RC, w_CD));
        if (want_weight) d_weight_CD.add_(at::mm(dlin_RC.t(), x_RD));
        if (want_bias) d_bias_V.narrow(0, c0, C).add_(dz_RC.sum(0));
      }
      if (want_weight) d_weight_VD.narrow(0, c0, C).copy_(d_weight_CD);
    }
  }
  torch::Tensor d_hidden;
  if (want_hidden) {
    const torch::Tensor d_KD = d_hidden_KD.to(s_.hidden_dtype);
    if (!layout_.slots_K.defined()) {  // full size, zeros at the rows that give no gradient
      const int64_t N = c10::multiply_integers(s_.hidden_sizes) / D;
      d_hidden = torch::zeros({N, D}, d_KD.options()).index_copy_(0, s_.rows_K, d_KD).view(s_.hidden_sizes);
    } else if (K == c10::multiply_integers(layout_.sizes) / D) {
      d_hidden = d_KD.view(layout_.sizes);  // every cut row contributes, in order
    } else {
      d_hidden = torch::zeros({c10::multiply_integers(layout_.sizes) / D, D}, d_KD.options())
                     .index_copy_(0, layout_.slots_K, d_KD)
                     .view(layout_.sizes);
    }
  }
  return {d_hidden, d_weight_VD, d_bias_V};
}

void check_head_arguments(const char* who, const torch::Tensor& hidden, const torch::Tensor& weight,
                          const torch::Tensor& targets, const torch::Tensor& keep, const HeadOptions& opts,
                          const torch::Tensor& bias) {
  if (!hidden.defined() || !weight.defined() || !targets.defined()) {
    throw Error(fmt::format("{}: hidden, weight and targets are required", who));
  }
  if (weight.dim() != 2 || hidden.dim() < 1 || hidden.size(-1) != weight.size(1)) {
    throw Error(fmt::format("{}: weight must be [V, D] with D the last size of hidden; got hidden [{}], weight [{}]",
                            who, fmt::join(hidden.sizes(), ", "), fmt::join(weight.sizes(), ", ")));
  }
  const auto lead = hidden.sizes().slice(0, hidden.dim() - 1);
  if (targets.sizes() != lead || targets.scalar_type() != c10::ScalarType::Long) {
    throw Error(fmt::format("{}: targets must be int64 [{}] (hidden's leading sizes); got {} [{}]", who,
                            fmt::join(lead, ", "), c10::toString(targets.scalar_type()),
                            fmt::join(targets.sizes(), ", ")));
  }
  if (keep.defined() && (keep.sizes() != lead || keep.scalar_type() != c10::ScalarType::Bool)) {
    throw Error(fmt::format("{}: keep must be bool [{}] (hidden's leading sizes); got {} [{}]", who,
                            fmt::join(lead, ", "), c10::toString(keep.scalar_type()), fmt::join(keep.sizes(), ", ")));
  }
  if (bias.defined() && (bias.dim() != 1 || bias.size(0) != weight.size(0))) {
    throw Error(fmt::format("{}: bias must be [{}]; got [{}]", who, weight.size(0), fmt::join(bias.sizes(), ", ")));
  }
  if (hidden.scalar_type() != weight.scalar_type() || (bias.defined() && bias.scalar_type() != weight.scalar_type())) {
    throw Error(fmt::format("{}: hidden, weight and bias must share one dtype; got {} and {}", who,
                            c10::toString(hidden.scalar_type()), c10::toString(weight.scalar_type())));
  }
  if (!c10::isFloatingType(hidden.scalar_type())) throw Error(fmt::format("{}: hidden must be floating point", who));
  if (opts.chunk_rows < 1 || opts.chunk_vocab < 1 || !(opts.divisor > 0.0) || opts.softcap < 0.0) {
    throw Error(fmt::format("{}: chunk_rows and chunk_vocab must be >= 1, divisor > 0 and softcap >= 0", who));
  }
  const torch::Tensor bad =
      targets.lt(0).logical_and(targets.ne(opts.ignore_index)).logical_or(targets.ge(weight.size(0)));
  if (bad.any().item<bool>()) {
    throw Error(fmt::format("{}: targets must lie in [0, {}) or equal ignore_index ({})", who, weight.size(0),
                            opts.ignore_index));
  }
}

}  // namespace detail

HeadResult fused_head_loss(const torch::Tensor& hidden, const torch::Tensor& weight, const torch::Tensor& targets,
                           const torch::Tensor& keep, const HeadOptions& opts, const torch::Tensor& bias) {
  ScoredHead scored = score_head(hidden, weight, targets, opts, bias);
  return HeadResult{scored.loss(keep, opts.divisor), scored.token_loss, scored.entropy};
}

}  // namespace collider
