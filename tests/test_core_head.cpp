// The fused LM head (collider/head.h) against the unfused head it replaces, in float64:
// Both ways of making the kept rows' gradient: in the forward (fused_head_loss's default) and
// recomputed in the backward (HeadOptions::recompute, what ScoredHead::loss does).
//   - alone: loss, every per-token score and entropy equal to a cross-entropy over the full
//     logits; the gradients of hidden states, weight and bias equal to plain autograd's of the
//     loss over the kept rows; at sizes where rows, vocabulary and chunks do not divide each other,
//     with ignore_index targets, a row that keeps nothing, soft-capping, a logit scale, a bias;
//   - inside filter_backward: a GPT-2 with a tied head (the embedding matrix), the fused head's
//     gradients equal to the unfused head's under Collider and to the oracle (mask_backward), both
//     semantics, eager and fused attention, equal and ragged keep masks, B > 1;
//   - a keep mask other than filter_backward's refused, the graph left as it was;
//   - bfloat16 within its own tolerance of the float64 head.
// Legend: B batch, T sequence, D hidden, V vocabulary, N = B * T rows.
// Run: build/tests/test_core_head
#include "collider_test_util.h"
#include "gpt2_test_model.h"

#include <gtest/gtest.h>

using namespace collider;
using namespace collider::testing;

namespace {

// The unfused head: full logits [N, V], per-row cross-entropy; the loss over kept rows / divisor.
struct Unfused {
  torch::Tensor loss, token_loss, entropy;
};
Unfused unfused_head(const torch::Tensor& x_ND, const torch::Tensor& w_VD, const torch::Tensor& b_V,
                     const torch::Tensor& target_N, const torch::Tensor& keep_N, const HeadOptions& o) {
  auto z = torch::matmul(x_ND, w_VD.t());
  if (b_V.defined()) z = z + b_V;
  z = z * o.logit_scale;
  if (o.softcap > 0) z = torch::tanh(z / o.softcap) * o.softcap;
  auto logp = torch::log_softmax(z, -1);
  Unfused u;
  u.token_loss = torch::nll_loss(logp, target_N, {}, at::Reduction::None, o.ignore_index);
  u.entropy = -(logp.exp() * logp).sum(-1);
  u.loss = (u.token_loss * keep_N).sum() / o.divisor;
  return u;
}

struct HeadCase {
  int64_t N, D, V, chunk_rows, chunk_vocab;
  double softcap, scale;
  bool bias;
};

class FusedHeadAlone : public ::testing::TestWithParam<HeadCase> {};

TEST_P(FusedHeadAlone, EqualsTheUnfusedHead) {
  const HeadCase c = GetParam();
  torch::manual_seed(7);
  auto opt = torch::TensorOptions().dtype(torch::kDouble);
  auto x = torch::randn({c.N, c.D}, opt).requires_grad_();
  auto w = torch::randn({c.V, c.D}, opt).mul_(0.5).requires_grad_();
  auto b = c.bias ? torch::randn({c.V}, opt).requires_grad_() : torch::Tensor();
  auto target = torch::randint(c.V, {c.N});
  target.index_put_({torch::arange(0, c.N, 5)}, -100);  // every fifth row ignored
  auto keep = torch::rand({c.N}) > 0.4;
  keep[1] = true;  // a kept row with an ignored target (row 0) and without
  HeadOptions o;
  o.softcap = c.softcap;
  o.logit_scale = c.scale;
  o.divisor = 3.0;
  o.entropy = true;
  o.chunk_rows = c.chunk_rows;
  o.chunk_vocab = c.chunk_vocab;

  auto params = c.bias ? std::vector<torch::Tensor>{x, w, b} : std::vector<torch::Tensor>{x, w};
  Unfused ref = unfused_head(x, w, b, target, keep, o);
  auto g_ref = torch::autograd::grad({ref.loss}, params);
  for (bool recompute : {false, true}) {  // the gradient made in the forward, or recomputed in the backward
  SCOPED_TRACE(recompute ? "recompute" : "eager");
  o.recompute = recompute;
  HeadResult got = fused_head_loss(x, w, target, keep, o, b);
  auto g_got = torch::autograd::grad({got.loss}, params);

  EXPECT_TRUE(torch::allclose(got.loss, ref.loss, 1e-12, 1e-12));
  EXPECT_TRUE(torch::allclose(got.token_loss, ref.token_loss, 1e-12, 1e-12));
  EXPECT_TRUE(torch::allclose(got.entropy, ref.entropy, 1e-12, 1e-12));
  EXPECT_FALSE(got.token_loss.requires_grad());
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(torch::allclose(g_got[i], g_ref[i], 1e-11, 1e-12)) << "gradient " << i;
  }
  // Dropped rows (and kept rows with an ignored target) get exactly zero.
  auto silent = keep.logical_not().logical_or(target.eq(-100));
  EXPECT_EQ(g_got[0].index({silent}).abs().max().item<double>(), 0.0);
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, FusedHeadAlone,
                         ::testing::Values(HeadCase{21, 5, 37, 4, 10, 0.0, 1.0, false},   // nothing divides
                                           HeadCase{21, 5, 37, 64, 64, 0.0, 1.0, true},   // one block, a bias
                                           HeadCase{33, 8, 50, 7, 9, 3.0, 1.0, false},    // soft-capping
                                           HeadCase{33, 8, 50, 7, 9, 0.0, 0.25, true},    // a logit scale
                                           HeadCase{13, 6, 11, 1, 1, 2.0, 0.5, true},     // blocks of one
                                           // whole-vocabulary blocks of 138 rows: the eager head's
                                           // weight gradient added over two blocks
                                           HeadCase{300, 5, 37, 2, 2560, 2.0, 0.5, true}));

TEST(FusedHead, EveryRowKeptEqualsPlainAutograd) {
  torch::manual_seed(3);
  auto x = torch::randn({2, 9, 6}, torch::kDouble).requires_grad_();
  auto w = torch::randn({23, 6}, torch::kDouble).requires_grad_();
  auto target = torch::randint(23, {2, 9});
  auto ref = torch::nll_loss(torch::log_softmax(torch::matmul(x, w.t()).reshape({-1, 23}), -1), target.reshape({-1}),
                             {}, at::Reduction::Sum);
  auto g_ref = torch::autograd::grad({ref}, {x, w});
  HeadOptions o;
  o.chunk_rows = 5;
  o.chunk_vocab = 4;
  auto got = fused_head_loss(x, w, target, torch::Tensor(), o).loss;
  auto g_got = torch::autograd::grad({got}, {x, w});
  EXPECT_TRUE(torch::allclose(got, ref, 1e-12, 1e-12));
  EXPECT_TRUE(torch::allclose(g_got[0], g_ref[0], 1e-11, 1e-12));
  EXPECT_TRUE(torch::allclose(g_got[1], g_ref[1], 1e-11, 1e-12));
}

TEST(FusedHead, NothingKeptGivesZeroGradients) {
  auto x = torch::randn({4, 3}, torch::kDouble).requires_grad_();
  auto w = torch::randn({7, 3}, torch::kDouble).requires_grad_();
  auto r = fused_head_loss(x, w, torch::randint(7, {4}), torch::zeros({4}, torch::kBool));
  EXPECT_EQ(r.loss.item<double>(), 0.0);
  r.loss.backward();
  EXPECT_EQ(x.grad().abs().max().item<double>(), 0.0);
  EXPECT_EQ(w.grad().abs().max().item<double>(), 0.0);
}

TEST(FusedHead, BadArgumentsAreRefused) {
  auto x = torch::randn({4, 3});
  auto w = torch::randn({7, 3});
  EXPECT_NE(error_of([&] { fused_head_loss(x, w, torch::full({4}, 7, torch::kLong), {}); }).find("[0, 7)"),
            std::string::npos);
  EXPECT_NE(error_of([&] { fused_head_loss(x, torch::randn({7, 4}), torch::zeros({4}, torch::kLong), {}); })
                .find("weight must be [V, D]"),
            std::string::npos);
  EXPECT_NE(error_of([&] { fused_head_loss(x, w, torch::zeros({4}, torch::kLong), torch::ones({4})); })
                .find("keep must be bool"),
            std::string::npos);
}

// The weight stepped between forward and backward: the recomputing head would recompute other
// logits, so it refuses; the eager head made its gradient in the forward, at the forward's weight.
TEST(FusedHead, WeightChangedBeforeBackward) {
  auto x = torch::randn({4, 3}).requires_grad_();
  auto w = torch::randn({7, 3}).requires_grad_();
  auto target = torch::randint(7, {4});
  HeadOptions o;
  o.recompute = true;
  auto r = fused_head_loss(x, w, target, {}, o);
  auto eager = fused_head_loss(x, w, target, {});
  auto g_before = torch::autograd::grad({fused_head_loss(x, w, target, {}).loss}, {w})[0];
  {
    torch::NoGradGuard no_grad;
    w.add_(1.0);
  }
  EXPECT_NE(error_of([&] { r.loss.backward(); }).find("modified in place"), std::string::npos);
  EXPECT_TRUE(torch::equal(torch::autograd::grad({eager.loss}, {w})[0], g_before));
}

TEST(FusedHead, Bfloat16WithinItsTolerance) {
  torch::manual_seed(11);
  auto x64 = torch::randn({40, 16}, torch::kDouble);
  auto w64 = torch::randn({300, 16}, torch::kDouble).mul_(0.3);
  auto target = torch::randint(300, {40});
  auto keep = torch::rand({40}) > 0.4;
  HeadOptions o;
  o.chunk_rows = 16;
  o.chunk_vocab = 128;
  auto run = [&](torch::ScalarType t) {
    auto x = x64.to(t).detach().requires_grad_(), w = w64.to(t).detach().requires_grad_();
    auto r = fused_head_loss(x, w, target, keep, o);
    r.loss.backward();
    return std::make_tuple(r.loss.to(torch::kDouble), r.token_loss.to(torch::kDouble), x.grad().to(torch::kDouble),
                           w.grad().to(torch::kDouble));
  };
  auto [l64, t64, gx64, gw64] = run(torch::kDouble);
  auto [l16, t16, gx16, gw16] = run(torch::kBFloat16);
  EXPECT_EQ(l16.scalar_type(), torch::kDouble);
  EXPECT_LE(((l16 - l64).abs() / l64.abs()).item<double>(), 2e-2);
  EXPECT_LE(((t16 - t64).abs().max() / t64.abs().max()).item<double>(), 3e-2);
  EXPECT_LE(((gx16 - gx64).abs().max() / gx64.abs().max()).item<double>(), 3e-2);
  EXPECT_LE(((gw16 - gw64).abs().max() / gw64.abs().max()).item<double>(), 3e-2);
}

// Inside filter_backward: a GPT-2 whose tied head is the fused head, against the same GPT-2 with
// the unfused head, both filtered, and against the oracle.
constexpr int64_t kV = 61, kD = 16, kH = 2, kL = 2;

struct FilteredCase {
  AttentionGrad attention;
  double ratio;
  int64_t B, T;
  bool sdpa, ragged;
};

torch::Tensor ragged_keep(int64_t B, int64_t T, uint64_t seed) {
  torch::manual_seed(seed);
  auto keep = torch::zeros({B, T}, torch::kBool);
  for (int64_t b = 0; b < B; ++b) keep[b].index_put_({torch::randperm(T).narrow(0, 0, 2 + (3 * b) % (T - 2))}, true);
  return keep;
}

class FusedHeadFiltered : public ::testing::TestWithParam<FilteredCase> {};

TEST_P(FusedHeadFiltered, EqualsTheUnfusedHeadUnderCollider) {
  const FilteredCase c = GetParam();
  torch::manual_seed(5);
  Gpt2 m(kV, kD, kH, kL, 64);
  m->to(torch::kDouble);
  m->use_sdpa = c.sdpa;
  auto idx = torch::randint(kV, {c.B, c.T});
  auto labels = torch::randint(kV, {c.B, c.T});
  auto keep = c.ragged ? ragged_keep(c.B, c.T, 17) : random_keep(c.B, c.T, c.ratio, 17);
  const double kept = keep.sum().item<double>();
  HeadOptions o;
  o.chunk_rows = 7;
  o.chunk_vocab = 16;
  o.divisor = kept;
  auto fused_loss = [&](const torch::Tensor& idx_BT, const torch::Tensor& labels_BT, const torch::Tensor& keep_BT) {
    return fused_head_loss(m->hidden(idx_BT), m->wte->weight, labels_BT, keep_BT, o).loss;
  };
  auto unfused_loss = [&](const torch::Tensor& idx_BT, const torch::Tensor& labels_BT, const torch::Tensor& keep_BT) {
    auto logits_NV = m->forward(idx_BT).reshape({-1, kV});
    auto target_N = labels_BT.masked_fill(keep_BT.logical_not(), -100).reshape({-1});
    return torch::nll_loss(torch::log_softmax(logits_NV, -1), target_N, {}, at::Reduction::Sum) / o.divisor;
  };
  auto trace = [&](auto loss_fn) {
    return trace_plan([&](int64_t B, int64_t T) {
      return loss_fn(torch::randint(kV, {B, T}), torch::randint(kV, {B, T}), torch::ones({B, T}, torch::kBool));
    });
  };
  FilterOptions f;
  f.attention = c.attention;
  f.check_every = 0;

  Plan unfused_plan = trace(unfused_loss);
  zero_grads(*m);
  auto loss_u = unfused_loss(idx, labels, keep);
  filter_backward(loss_u, keep, unfused_plan, f);
  loss_u.backward();
  auto g_unfused = grads_of(*m);

  Plan fused_plan = trace(fused_loss);
  zero_grads(*m);
  auto loss_o = fused_loss(idx, labels, keep);
  mask_backward(loss_o, keep, fused_plan, f);
  loss_o.backward();
  auto g_oracle = grads_of(*m);

  for (bool recompute : {false, true}) {  // the gradient made in the forward, or recomputed in the backward
    SCOPED_TRACE(recompute ? "recompute" : "eager");
    o.recompute = recompute;
    zero_grads(*m);
    auto loss_f = fused_loss(idx, labels, keep);
    EXPECT_TRUE(torch::allclose(loss_f, loss_u, 1e-12, 1e-12));
    FilterOptions checked = f;
    checked.validate = true;  // and the step checked against mask_backward inside the call
    FilterStats st = filter_backward(loss_f, keep, fused_plan, checked);
    loss_f.backward();
    auto g_fused = grads_of(*m);
    EXPECT_EQ(st.checked, 1);

    std::string worst;
    EXPECT_LE(max_rel_diff(g_fused, g_unfused, &worst), 1e-10) << worst;
    EXPECT_LE(max_rel_diff(g_fused, g_oracle, &worst), 1e-10) << worst;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, FusedHeadFiltered,
    ::testing::Values(FilteredCase{AttentionGrad::kKeptOnly, 0.4, 2, 24, false, false},
                      FilteredCase{AttentionGrad::kExactQuery, 0.4, 2, 24, false, false},
                      FilteredCase{AttentionGrad::kKeptOnly, 0.7, 3, 20, true, false},
                      FilteredCase{AttentionGrad::kExactQuery, 0.7, 3, 20, true, false},
                      FilteredCase{AttentionGrad::kKeptOnly, 0.0, 3, 19, false, true},
                      FilteredCase{AttentionGrad::kExactQuery, 0.0, 3, 19, true, true}),
    [](const ::testing::TestParamInfo<FilteredCase>& info) {
      const auto& c = info.param;
      return std::string(to_string(c.attention)) + (c.ragged ? "_ragged" : "_r" + std::to_string(int(c.ratio * 100))) +
             "_B" + std::to_string(c.B) + (c.sdpa ? "_sdpa" : "_eager");
    });

TEST(FusedHead, AnotherKeepMaskThanFilterBackwardsIsRefused) {
  torch::manual_seed(9);
  Gpt2 m(kV, kD, kH, kL, 64);
  m->to(torch::kDouble);
  auto plan = trace_plan([&](int64_t B, int64_t T) {
    return fused_head_loss(m->hidden(torch::randint(kV, {B, T})), m->wte->weight, torch::randint(kV, {B, T}),
                           torch::ones({B, T}, torch::kBool))
        .loss;
  });
  auto idx = torch::randint(kV, {2, 16});
  auto labels = torch::randint(kV, {2, 16});
  auto head_keep = random_keep(2, 16, 0.5, 1), other = random_keep(2, 16, 0.5, 2);
  zero_grads(*m);
  auto ref = fused_head_loss(m->hidden(idx), m->wte->weight, labels, head_keep).loss;
  ref.backward();
  auto g_ref = grads_of(*m);

  zero_grads(*m);
  auto loss = fused_head_loss(m->hidden(idx), m->wte->weight, labels, head_keep).loss;
  const std::string what = error_of([&] { filter_backward(loss, other, plan); });
  EXPECT_NE(what.find("another keep mask"), std::string::npos) << what;
  loss.backward();  // the graph as it was: the plain backward of the head's own loss
  EXPECT_LE(max_rel_diff(grads_of(*m), g_ref), 1e-12);
}

}  // namespace
