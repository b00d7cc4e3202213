// Shared helpers for the Collider gradient tests: per-token loss, keep masks, gradient
// snapshots and the relative max-difference metric of the issue (max|a-b| / max|ref|).
#pragma once

#include <collider/collider.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>

namespace collider::testing {

// labels_BT pre-shifted; returns mean loss over kept positions.
inline torch::Tensor masked_ce(const torch::Tensor& logits_BTV, const torch::Tensor& labels_BT,
                               const torch::Tensor& keep_BT) {
  const auto V = logits_BTV.size(-1);
  auto loss_BT = torch::nll_loss(torch::log_softmax(logits_BTV.reshape({-1, V}).to(torch::kFloat), -1),
                                 labels_BT.reshape({-1}), {}, at::Reduction::None)
                     .view(labels_BT.sizes());
  auto keep = keep_BT.to(loss_BT.scalar_type());
  return (loss_BT * keep).sum() / keep.sum();
}

// One gradient test point: semantics, filter_ratio, B, T; printed and named readably in CTest.
struct GradCase {
  AttentionGrad attention;
  double ratio;
  int64_t B, T;
};
inline void PrintTo(const GradCase& c, std::ostream* os) {
  *os << to_string(c.attention) << " r=" << c.ratio << " B=" << c.B << " T=" << c.T;
}
inline std::string grad_case_name(const ::testing::TestParamInfo<GradCase>& info) {
  const auto& c = info.param;
  return std::string(to_string(c.attention)) + "_r" + std::to_string(static_cast<int>(c.ratio * 100)) + "_B" +
         std::to_string(c.B) + "_T" + std::to_string(c.T);
}

// The message of the exception f() throws, "(no error)" when it throws none.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) { return e.what(); }
  return "(no error)";
}

inline torch::Tensor random_keep(int64_t B, int64_t T, double ratio, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto scores = at::rand({B, T}, gen);
  collider::SelectOptions opts;
  opts.align = 1;  // exact ratios (0.9 of T=64 cannot be rounded up to a multiple of 8)
  return collider::select_tokens(scores, ratio, opts);
}

inline std::map<std::string, torch::Tensor> grads_of(torch::nn::Module& m) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : m.named_parameters()) {
    if (p.value().grad().defined()) out[p.key()] = p.value().grad().clone();
  }
  return out;
}

inline void zero_grads(torch::nn::Module& m) {
  for (auto& p : m.parameters()) p.mutable_grad() = torch::Tensor();
}

// Largest over parameters of max|a - b| / max|b| (b = reference); also reports which.
inline double max_rel_diff(const std::map<std::string, torch::Tensor>& a, const std::map<std::string, torch::Tensor>& b,
                           std::string* worst = nullptr) {
  double out = 0;
  for (const auto& [name, ref] : b) {
    auto it = a.find(name);
    if (it == a.end()) return 1e30;
    const double denom = std::max(ref.abs().max().item<double>(), 1e-12);
    const double d = (it->second - ref).abs().max().item<double>() / denom;
    if (d > out) {
      out = d;
      if (worst) *worst = name;
    }
  }
  if (a.size() != b.size()) return 1e30;
  return out;
}

// filter_ratio 0 (every token kept) reproduces the plain backward, for both semantics. `m` is a
// module holder whose forward(idx_BT) gives logits [B, T, V].
template <typename Model>
void expect_ratio_zero_equals_regular(Model& m, const Plan& plan, int64_t vocab, int64_t B, int64_t T, double tol) {
  auto idx = torch::randint(vocab, {B, T});
  auto labels = torch::randint(vocab, {B, T});
  auto keep = torch::ones({B, T}, torch::kBool);
  zero_grads(*m);
  masked_ce(m->forward(idx), labels, keep).backward();
  auto g_regular = grads_of(*m);
  for (auto a : {AttentionGrad::kKeptOnly, AttentionGrad::kExactQuery}) {
    zero_grads(*m);
    auto loss = masked_ce(m->forward(idx), labels, keep);
    filter_backward(loss, keep, plan, {a});
    loss.backward();
    EXPECT_LE(max_rel_diff(grads_of(*m), g_regular), tol) << to_string(a);
  }
}

}  // namespace collider::testing
