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
#include <torch/csrc/autograd/graph_task.h>

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

// The soft-capping's derivative at the capped logits z: d(c tanh(u / c)) / du = 1 - (z / c)^2.
torch::Tensor cap_derivative(const torch::Tensor& z, double softcap) { return 1.0 - (z / softcap).square_(); }

// The block's column of each row's target (clamped into the block) and whether it lies there.
std::pair<torch::Tensor, torch::Tensor> target_in_block(const torch::Tensor& target_R, int64_t c0, int64_t C) {
  torch::Tensor in_R = target_R.ge(c0).logical_and_(target_R.lt(c0 + C));
  return {(target_R - c0).clamp_(0, C - 1), in_R};
}

// Every row's log-sum-exp, target logit and (o.entropy) entropy, in blocks of o.chunk_rows rows and
// o.chunk_vocab columns with an online log-sum-exp: at most one block of logits alive.
struct RowScores {
  torch::Tensor lse_N, zt_N, entropy_N;
};
RowScores score_rows(const torch::Tensor& x_ND, const torch::Tensor& target_N, const torch::Tensor& w_VD,
                     const torch::Tensor& b_V, const HeadOptions& o) {
  const int64_t N = x_ND.size(0), V = w_VD.size(0);
  const auto acc = accumulation(x_ND.scalar_type());
  RowScores out;
  out.lse_N = torch::empty({N}, x_ND.options().dtype(acc));
  out.zt_N = torch::zeros({N}, x_ND.options().dtype(acc));
  if (o.entropy) out.entropy_N = torch::empty({N}, x_ND.options().dtype(acc));
  for (int64_t r0 = 0; r0 < N; r0 += o.chunk_rows) {
    const int64_t R = std::min(o.chunk_rows, N - r0);
    const torch::Tensor x_RD = x_ND.narrow(0, r0, R), target_R = target_N.narrow(0, r0, R);
    // Running maximum m, sum of exp(z - m) s, and (entropy) sum of exp(z - m) z a, per row.
    torch::Tensor m_R = torch::full({R}, -std::numeric_limits<double>::infinity(), out.lse_N.options());
    torch::Tensor s_R = torch::zeros({R}, out.lse_N.options());
    torch::Tensor a_R = o.entropy ? torch::zeros({R}, out.lse_N.options()) : torch::Tensor();
    torch::Tensor zt_R = out.zt_N.narrow(0, r0, R);
    for (int64_t c0 = 0; c0 < V; c0 += o.chunk_vocab) {
      const int64_t C = std::min(o.chunk_vocab, V - c0);
      const torch::Tensor z_RC = logits_block(x_RD, w_VD, b_V, c0, C, o);
      const torch::Tensor m_new_R = torch::maximum(m_R, std::get<0>(z_RC.max(1)));
      const torch::Tensor rescale_R = (m_R - m_new_R).exp_();
      auto [col_R, in_R] = target_in_block(target_R, c0, C);
      zt_R.add_(z_RC.gather(1, col_R.unsqueeze(1)).squeeze(1).mul_(in_R));
      if (o.entropy) a_R.mul_(rescale_R).add_((z_RC - m_new_R.unsqueeze(1)).exp_().mul_(z_RC).sum(1));
      s_R.mul_(rescale_R).add_(z_RC.sub_(m_new_R.unsqueeze(1)).exp_().sum(1));  // z_RC is spent here
      m_R = m_new_R;
    }
    out.lse_N.narrow(0, r0, R).copy_(m_R + s_R.log());
    if (o.entropy) out.entropy_N.narrow(0, r0, R).copy_(out.lse_N.narrow(0, r0, R) - a_R / s_R);
  }
  return out;
}

// The gradient of a block's linear outputs x W^T + b: (softmax(z) - onehot(target)) * coef, through
// the capping and the scale. z_RC: the block's logits (columns c0 .. c0 + C - 1), overwritten.
torch::Tensor block_gradient(torch::Tensor z_RC, const torch::Tensor& lse_R, const torch::Tensor& target_R, int64_t c0,
                             const torch::Tensor& coef, const HeadOptions& o) {
  torch::Tensor cap_RC;
  if (o.softcap > 0.0) cap_RC = cap_derivative(z_RC, o.softcap);
  torch::Tensor dz_RC = z_RC.sub_(lse_R.unsqueeze(1)).exp_();           // softmax
  auto [col_R, in_R] = target_in_block(target_R, c0, dz_RC.size(1));
  dz_RC.scatter_add_(1, col_R.unsqueeze(1), in_R.to(dz_RC.scalar_type()).neg_().unsqueeze(1));  // - onehot
  dz_RC.mul_(coef);
  if (cap_RC.defined()) dz_RC.mul_(cap_RC);
  if (o.logit_scale != 1.0) dz_RC.mul_(o.logit_scale);
  return dz_RC;
}

// The rows' log-sum-exp, target logit and (o.entropy) entropy from a block of whole-vocabulary
// logits z_RV, which it overwrites: with `gradient`, in place into the gradient of the linear
// outputs for an upstream gradient of 1, (softmax(z) - onehot(target)) * logit_scale / divisor
// times the capping's derivative (every target must then be a vocabulary index). Four or five
// passes (max, shift, exp, sum, scale) over sub-blocks of about 1M logits, each pass of a
// sub-block reading what the last left in cache.
RowScores scores_in_place(const torch::Tensor& z_RV, const torch::Tensor& target_R, const HeadOptions& o,
                          bool gradient) {
  const int64_t R = z_RV.size(0), V = z_RV.size(1);
  const int64_t S = std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(V, 1));
  const double f = o.logit_scale / o.divisor;
  RowScores out;
  out.lse_N = torch::empty({R}, z_RV.options());
  auto [col_R, in_R] = target_in_block(target_R, 0, V);
  out.zt_N = z_RV.gather(1, col_R.unsqueeze(1)).squeeze(1).mul_(in_R);
  if (o.entropy) out.entropy_N = torch::empty({R}, z_RV.options());
  for (int64_t r0 = 0; r0 < R; r0 += S) {
    const int64_t n = std::min(S, R - r0);
    const torch::Tensor z = z_RV.narrow(0, r0, n), target = target_R.narrow(0, r0, n).unsqueeze(1);
    torch::Tensor cap;
    if (gradient && o.softcap > 0.0) cap = cap_derivative(z, o.softcap);
    const torch::Tensor m = at::amax(z, {1});
    z.sub_(m.unsqueeze(1));  // z - m
    torch::Tensor zm_e;      // (entropy) sum of (z - m) exp(z - m)
    if (o.entropy) {
      const torch::Tensor e = z.exp();
      zm_e = (e * z).sum(1);
      z.copy_(e);
    } else {
      z.exp_();
    }
    const torch::Tensor sum = z.sum(1), log_sum = sum.log();
    out.lse_N.narrow(0, r0, n).copy_(m + log_sum);
    if (o.entropy) out.entropy_N.narrow(0, r0, n).copy_(log_sum - zm_e / sum);
    if (!gradient) continue;
    z.mul_((f / sum).unsqueeze(1));
    z.scatter_add_(1, target, torch::full({n, 1}, -f, z.options()));
    if (cap.defined()) z.mul_(cap);
  }
  return out;
}

// acc += a b (acc in the accumulation dtype, a and b in the inputs').
void add_mm(const torch::Tensor& acc, const torch::Tensor& a, const torch::Tensor& b) {
  if (acc.scalar_type() == a.scalar_type()) {
    acc.addmm_(a, b);
  } else {
    acc.add_(at::mm(a, b));
  }
}

}  // namespace
}  // namespace detail

ScoredHead score_head(const torch::Tensor& hidden, const torch::Tensor& weight, const torch::Tensor& targets,
                      const HeadOptions& o, const torch::Tensor& bias) {
  detail::check_head_arguments("collider::score_head", hidden, weight, targets, torch::Tensor(), o, bias);
  const int64_t D = weight.size(1);
  torch::NoGradGuard no_grad;
  const detail::NoAutocast no_autocast;
  const torch::Tensor x_ND = hidden.detach().reshape({-1, D});
  const torch::Tensor target_N = targets.reshape({-1});
  const torch::Tensor w = weight.detach(), b = bias.defined() ? bias.detach() : torch::Tensor();
  auto [lse_N, zt_N, entropy_N] = detail::score_rows(x_ND, target_N, w, b, o);
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
  s.accumulation = lse_.scalar_type();
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
  s_.d_hidden_KD = s_.d_weight_VD = s_.d_bias_V = torch::Tensor();
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
  if (s_.eager) return emit(grads.at(0));
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
        const torch::Tensor dz_RC = block_gradient(logits_block(x_RD, w_VD, s_.bias_V, c0, C, o),
                                                   s_.lse_K.narrow(0, r0, R), s_.target_K.narrow(0, r0, R), c0, coef, o);
        const torch::Tensor dlin_RC = dz_RC.to(s_.hidden_dtype);
        if (want_hidden) add_mm(d_hidden_KD.narrow(0, r0, R), dlin_RC, w_CD);
        if (want_weight) add_mm(d_weight_CD, dlin_RC.t(), x_RD);
        if (want_bias) d_bias_V.narrow(0, c0, C).add_(dz_RC.sum(0));
      }
      if (want_weight) d_weight_VD.narrow(0, c0, C).copy_(d_weight_CD);
    }
  }
  return {want_hidden ? to_layout(d_hidden_KD) : torch::Tensor(), d_weight_VD, d_bias_V};
}

torch::autograd::variable_list FusedHeadNode::emit(const torch::Tensor& upstream) {
  if (!upstream.defined()) return {torch::Tensor(), torch::Tensor(), torch::Tensor()};  // a zero gradient
  const torch::Tensor g = upstream.to(s_.accumulation);
  // The last backward through this graph (no retain_graph) scales the saved gradients in place and
  // hands them on: no second [V, D] buffer. Another backward may follow otherwise (validate runs two).
  const bool last = !torch::autograd::get_current_graph_task_keep_graph();
  auto scaled = [&](torch::Tensor& d, c10::ScalarType dtype, bool wanted) {
    if (!d.defined() || !wanted) return torch::Tensor();
    torch::Tensor out = last ? d.mul_(g) : d * g;
    if (last) d = torch::Tensor();
    return out.to(dtype);
  };
  const torch::Tensor d_hidden_KD = scaled(s_.d_hidden_KD, s_.accumulation, should_compute_output(0));
  return {d_hidden_KD.defined() ? to_layout(d_hidden_KD) : torch::Tensor(),
          scaled(s_.d_weight_VD, s_.weight_VD.scalar_type(), should_compute_output(1)),
          s_.bias_V.defined() ? scaled(s_.d_bias_V, s_.bias_V.scalar_type(), should_compute_output(2))
                              : torch::Tensor()};
}

torch::Tensor FusedHeadNode::to_layout(const torch::Tensor& d_hidden_KD) const {
  const int64_t D = d_hidden_KD.size(1), K = d_hidden_KD.size(0);
  torch::Tensor d_hidden;
  {
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
  return d_hidden;
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

namespace {

// The fewest whole-vocabulary rows per block for which fused_head_loss makes the gradient in the
// forward (below, it recomputes, unless one block holds every row): chunk_rows * chunk_vocab / V.
// The eager head adds each block's share of the weight's [V, D] gradient into it, and with few
// rows per block that traffic costs more than the recompute (CPU, V = 151936, D = 512, N = 2048,
// one quick pass against the unfused head under Collider: blocks of 55 rows 1.19x, the recompute
// 1.16x, 128 rows 1.00x; the interleaved python/bench/bench_head.py: 256-row blocks 1.18x, the
// recompute 1.44x).
constexpr int64_t kEagerMinRows = 128;

// fused_head_loss with a gradient to make: the keep mask is known in the forward, so the counted
// rows (kept, target not ignore_index) are scored a block of whole-vocabulary rows at a time and
// their gradient made right there, for an upstream gradient of 1; the backward only scales it.
// 2 N D V + 4 K D V FLOPs, no recompute; the other rows are scored as score_head scores them.
HeadResult eager_head_loss(const torch::Tensor& hidden, const torch::Tensor& weight, const torch::Tensor& targets,
                           const torch::Tensor& keep, const HeadOptions& o, const torch::Tensor& bias) {
  const int64_t D = weight.size(1), V = weight.size(0);
  const auto acc = detail::accumulation(hidden.scalar_type());
  torch::NoGradGuard no_grad;
  const detail::NoAutocast no_autocast;
  const torch::Tensor x_ND = hidden.detach().reshape({-1, D});
  const torch::Tensor target_N = targets.reshape({-1});
  const torch::Tensor keep_N = keep.reshape({-1});
  const torch::Tensor w = weight.detach(), b = bias.defined() ? bias.detach() : torch::Tensor();
  const torch::Tensor counted_N = target_N.ne(o.ignore_index).logical_and_(keep_N);
  const torch::Tensor rows_K = counted_N.nonzero().squeeze(1);
  const torch::Tensor rest_M = counted_N.logical_not().nonzero().squeeze(1);
  const int64_t K = rows_K.size(0);

  // Every row in whole-vocabulary blocks of R rows (R * V within chunk_rows * chunk_vocab): first
  // the rows that give no gradient, scored only, then the counted rows.
  const int64_t N = x_ND.size(0), M = rest_M.size(0);
  const int64_t R_max = std::max<int64_t>(1, o.chunk_rows * o.chunk_vocab / V);
  torch::Tensor lse_N = torch::empty({N}, x_ND.options().dtype(acc));
  torch::Tensor zt_N = torch::zeros({N}, x_ND.options().dtype(acc));
  torch::Tensor entropy_N = o.entropy ? torch::empty({N}, x_ND.options().dtype(acc)) : torch::Tensor();
  auto record = [&](const torch::Tensor& idx_R, const detail::RowScores& scores) {
    lse_N.index_copy_(0, idx_R, scores.lse_N);
    zt_N.index_copy_(0, idx_R, scores.zt_N);
    if (o.entropy) entropy_N.index_copy_(0, idx_R, scores.entropy_N);
  };
  for (int64_t r0 = 0; r0 < M; r0 += R_max) {
    const torch::Tensor idx_R = rest_M.narrow(0, r0, std::min(R_max, M - r0));
    torch::Tensor z_RV = detail::logits_block(x_ND.index_select(0, idx_R), w, b, 0, V, o);
    record(idx_R, detail::scores_in_place(z_RV, target_N.index_select(0, idx_R), o, /*gradient=*/false));
  }

  const bool want_hidden = hidden.requires_grad(), want_weight = weight.requires_grad(),
             want_bias = bias.defined() && bias.requires_grad();
  detail::FusedHeadNode::Saved s;
  s.eager = true;
  s.accumulation = acc;
  if (want_hidden) s.d_hidden_KD = torch::empty({K, D}, x_ND.options().dtype(acc));
  if (want_weight) s.d_weight_VD = torch::zeros({V, D}, x_ND.options().dtype(acc));
  if (want_bias) s.d_bias_V = torch::zeros({V}, x_ND.options().dtype(acc));
  for (int64_t r0 = 0; r0 < K; r0 += R_max) {
    const int64_t R = std::min(R_max, K - r0);
    const torch::Tensor idx_R = rows_K.narrow(0, r0, R);
    const torch::Tensor x_RD = x_ND.index_select(0, idx_R), target_R = target_N.index_select(0, idx_R);
    torch::Tensor dz_RV = detail::logits_block(x_RD, w, b, 0, V, o);
    record(idx_R, detail::scores_in_place(dz_RV, target_R, o, /*gradient=*/true));
    const torch::Tensor dlin_RV = dz_RV.to(hidden.scalar_type());
    if (want_hidden) s.d_hidden_KD.narrow(0, r0, R).copy_(at::mm(dlin_RV, w));
    if (want_weight) detail::add_mm(s.d_weight_VD, dlin_RV.t(), x_RD);
    if (want_bias) s.d_bias_V.add_(dz_RV.sum(0));
  }

  HeadResult out;
  out.token_loss = (lse_N - zt_N).mul_(target_N.ne(o.ignore_index)).view(targets.sizes());
  if (o.entropy) out.entropy = entropy_N.view(targets.sizes());
  out.loss = (out.token_loss.reshape({-1}) * counted_N).sum() / o.divisor;
  s.opts = o;
  s.divisor = o.divisor;
  s.rows_K = rows_K;
  s.keep = keep;
  s.weight_VD = w;
  if (bias.defined()) s.bias_V = b;
  s.hidden_sizes = hidden.sizes().vec();
  s.hidden_dtype = hidden.scalar_type();
  auto node = make_node<detail::FusedHeadNode>(std::move(s));
  node->set_next_edges(torch::autograd::collect_next_edges(hidden, weight, bias));
  const uint32_t input_nr = node->add_input_metadata(out.loss);
  torch::autograd::impl::set_gradient_edge(out.loss, torch::autograd::Edge(NodePtr(node), input_nr));
  return out;
}

}  // namespace

bool fused_head_recomputes(int64_t rows, int64_t vocab, const HeadOptions& opts) {
  const int64_t block_rows = opts.chunk_rows * opts.chunk_vocab / std::max<int64_t>(vocab, 1);
  const bool few_rows = block_rows < kEagerMinRows && block_rows < rows;  // one block of every row is not few
  return opts.recompute || few_rows;
}

HeadResult fused_head_loss(const torch::Tensor& hidden, const torch::Tensor& weight, const torch::Tensor& targets,
                           const torch::Tensor& keep, const HeadOptions& opts, const torch::Tensor& bias) {
  const bool wants_grad = torch::GradMode::is_enabled() &&
                          (hidden.requires_grad() || weight.requires_grad() || (bias.defined() && bias.requires_grad()));
  const int64_t N = weight.size(1) > 0 ? hidden.numel() / weight.size(1) : 0;
  if (!wants_grad || fused_head_recomputes(N, weight.size(0), opts)) {
    ScoredHead scored = score_head(hidden, weight, targets, opts, bias);
    return HeadResult{scored.loss(keep, opts.divisor), scored.token_loss, scored.entropy};
  }
  detail::check_head_arguments("collider::fused_head_loss", hidden, weight, targets, keep, opts, bias);
  const torch::Tensor keep_all = keep.defined() ? keep : torch::ones(targets.sizes(), targets.options().dtype(torch::kBool));
  return eager_head_loss(hidden, weight, targets, keep_all, opts, bias);
}

}  // namespace collider
