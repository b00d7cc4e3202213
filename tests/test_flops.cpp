// Unit tests of the analytic FLOP counts (models/flops.h): hand-computed paper-model values,
// dense backward = 2x forward, the filtered modes at N = T equal dense and grow with N, the
// attention/linear ratio of the paper models, the -mini sizing rule of DESIGN.md section 7, and
// forward_drop (middle layers at N tokens per row; also through its MethodSpec, as rows count it),
// ragged rows counted row by row and the FLOP ideal on them.
// Run: build/tests/test_flops
// Legend: B batch, T sequence, N kept tokens per row.
#include "models/flops.h"

#include <gtest/gtest.h>

using namespace collider::models;

namespace {
// The backwards the formulas distinguish: dense (regular; loss_only and masked count the same)
// and collider with each attention gradient.
const MethodSpec kDense{};
const MethodSpec kKeptOnly{Method::kCollider, collider::AttentionGrad::kKeptOnly};
const MethodSpec kExactQuery{Method::kCollider, collider::AttentionGrad::kExactQuery};
}  // namespace

TEST(Flops, TinyLlamaForwardByHand) {
  const auto& c = preset("tinyllama-1.1b");
  const double T = 2048;
  // per layer per token: 2 * (2048*2048 q + 2*2048*256 k,v + 2048*2048 o + 3*2048*5632 MLP)
  const double lin_tok = 2.0 * (2048.0 * 2048 * 2 + 2 * 2048.0 * 256 + 3 * 2048.0 * 5632);
  auto f = forward_flops(c, 3, 2048);
  EXPECT_DOUBLE_EQ(f.linear, 3 * T * 22 * lin_tok);
  EXPECT_DOUBLE_EQ(f.attention, 22 * 2 * 2.0 * 3 * 32 * T * T * 64);
  EXPECT_DOUBLE_EQ(f.lm_head, 2.0 * 3 * T * 2048 * 32000);
  EXPECT_DOUBLE_EQ(f.total(), f.linear + f.attention + f.lm_head);
}

TEST(Flops, PhiCountsTwoMlpMatrices) {
  const auto& c = preset("phi-1.5");
  auto f = forward_flops(c, 1, 1);
  EXPECT_DOUBLE_EQ(f.linear, 24 * 2.0 * (4 * 2048.0 * 2048 + 2 * 2048.0 * 8192));
}

TEST(Flops, DenseBackwardIsTwiceForward) {
  for (const auto& c : presets()) {
    auto f = forward_flops(c, 2, 300);
    auto b = backward_flops(c, 2, 300, 300, kDense);
    EXPECT_DOUBLE_EQ(b.linear, 2 * f.linear) << c.name;
    EXPECT_DOUBLE_EQ(b.attention, 2 * f.attention) << c.name;
    EXPECT_DOUBLE_EQ(b.lm_head, 2 * f.lm_head) << c.name;
  }
}

TEST(Flops, FilteredModesAtFullKeepEqualDenseAndGrowWithN) {
  for (const auto& c : presets()) {
    const int64_t T = 512;
    auto dense = backward_flops(c, 2, T, T, kDense);
    for (const MethodSpec& mode : {kKeptOnly, kExactQuery}) {
      auto full = backward_flops(c, 2, T, T, mode);
      EXPECT_DOUBLE_EQ(full.total(), dense.total()) << c.name << " " << collider::to_string(mode.attention_grad);
      double prev = 0;
      for (int64_t N = 8; N <= T; N += 8) {
        auto b = backward_flops(c, 2, T, N, mode);
        EXPECT_GT(b.total(), prev) << c.name << " N=" << N;
        EXPECT_LE(b.total(), dense.total());
        prev = b.total();
      }
    }
    // exact_query keeps the T-long key side: more attention work than kept_only below N = T.
    auto ko = backward_flops(c, 2, T, T / 2, kKeptOnly);
    auto eq = backward_flops(c, 2, T, T / 2, kExactQuery);
    EXPECT_DOUBLE_EQ(eq.attention, 2 * ko.attention);
    EXPECT_DOUBLE_EQ(eq.linear, ko.linear);
    EXPECT_DOUBLE_EQ(ko.attention, 2 * forward_flops(c, 2, T / 2).attention);
  }
}

TEST(Flops, RaggedRowsCountRowByRow) {
  const auto& c = preset("tinyllama-mini");
  const int64_t T = 512;
  for (const MethodSpec& mode : {kKeptOnly, kExactQuery}) {
    // Equal rows: the same as the batch count; a row that keeps nothing adds nothing.
    EXPECT_DOUBLE_EQ(backward_flops_rows(c, T, {304, 304, 304}, mode).total(),
                     backward_flops(c, 3, T, 304, mode).total());
    EXPECT_DOUBLE_EQ(backward_flops_rows(c, T, {200, 0, 400}, mode).total(),
                     backward_flops(c, 1, T, 200, mode).total() + backward_flops(c, 1, T, 400, mode).total());
    EXPECT_DOUBLE_EQ(flop_ideal_reduction(c, T, {304, 304}, mode),
                     1 - backward_flops(c, 2, T, 304, mode).total() / backward_flops(c, 2, T, T, kDense).total());
  }
  // The dense methods count every token whatever the kept counts say.
  EXPECT_DOUBLE_EQ(flop_ideal_reduction(c, T, {T, T}, kDense), 0.0);
  EXPECT_THROW(backward_flops_rows(c, T, {}, kKeptOnly), std::invalid_argument);
}

TEST(Flops, RejectsBadSizes) {
  const auto& c = preset("tinyllama-debug");
  EXPECT_THROW(forward_flops(c, 0, 8), std::invalid_argument);
  EXPECT_THROW(backward_flops(c, 1, 8, 9, kKeptOnly), std::invalid_argument);
  EXPECT_THROW(backward_flops(c, 1, 8, 0, kExactQuery), std::invalid_argument);
}

TEST(Flops, PaperAttentionLinearRatios) {
  EXPECT_NEAR(attention_linear_ratio(preset("tinyllama-1.1b"), 2048), 0.1905, 1e-3);
  EXPECT_NEAR(attention_linear_ratio(preset("qwen2.5-1.5b"), 2048), 0.1345, 1e-3);
  EXPECT_NEAR(attention_linear_ratio(preset("phi-1.5"), 2048), 0.1667, 1e-3);
}

// DESIGN.md section 7: at the CPU sequence lengths 512 and 1024 the -mini presets keep the
// attention/linear FLOP ratio within 2x of their paper model's at T = 2048.
TEST(Flops, MiniPresetsStayRepresentative) {
  for (auto [paper, mini] : {std::pair{"tinyllama-1.1b", "tinyllama-mini"}, std::pair{"qwen2.5-1.5b", "qwen2.5-mini"},
                             std::pair{"phi-1.5", "phi-1.5-mini"}}) {
    const double ref = attention_linear_ratio(preset(paper), 2048);
    for (int64_t T : {512, 1024}) {
      const double r = attention_linear_ratio(preset(mini), T);
      EXPECT_GE(r, ref / 2) << mini << " T=" << T;
      EXPECT_LE(r, ref * 2) << mini << " T=" << T;
    }
  }
}

// forward_drop: TinyLlama-1.1B by hand (22 layers: 2 at T, 20 at N), N = T gives the dense
// counts, the backward is twice the forward, and bad sizes are refused.
TEST(Flops, ForwardDropCountsTheMiddleLayersAtNByHand) {
  const auto& c = preset("tinyllama-1.1b");
  const double T = 2048, N = 1229;
  const double lin_tok = 2.0 * (2048.0 * 2048 * 2 + 2 * 2048.0 * 256 + 3 * 2048.0 * 5632);
  auto f = forward_drop_forward_flops(c, 3, 2048, 1229);
  EXPECT_DOUBLE_EQ(f.linear, 3 * T * 2 * lin_tok + 3 * N * 20 * lin_tok);
  EXPECT_DOUBLE_EQ(f.attention, 2 * 2 * 2.0 * 3 * 32 * T * T * 64 + 20 * 2 * 2.0 * 3 * 32 * N * N * 64);
  EXPECT_DOUBLE_EQ(f.lm_head, 2.0 * 3 * T * 2048 * 32000);
  auto b = forward_drop_backward_flops(c, 3, 2048, 1229);
  EXPECT_DOUBLE_EQ(b.linear, 2 * f.linear);
  EXPECT_DOUBLE_EQ(b.attention, 2 * f.attention);
  EXPECT_DOUBLE_EQ(b.lm_head, 2 * f.lm_head);
  for (const char* name : {"tinyllama-mini", "qwen2.5-mini", "phi-1.5-mini"}) {
    const auto& m = preset(name);
    EXPECT_DOUBLE_EQ(forward_drop_forward_flops(m, 2, 256, 256).total(), forward_flops(m, 2, 256).total()) << name;
    EXPECT_LT(forward_drop_forward_flops(m, 2, 256, 128).total(), forward_flops(m, 2, 256).total()) << name;
  }
  EXPECT_THROW(forward_drop_forward_flops(c, 1, 16, 0), std::invalid_argument);
  EXPECT_THROW(forward_drop_forward_flops(c, 1, 16, 17), std::invalid_argument);
  EXPECT_THROW(forward_drop_forward_flops(preset("tinyllama-debug"), 1, 16, 8), std::invalid_argument);
}

// The method-aware counts a row takes: forward_drop's forward and backward through the
// MethodSpec equal its own formulas at the middle-layer count; every other method's forward is
// the dense one whatever N says.
TEST(Flops, ForwardDropThroughTheMethodSpec) {
  const auto& c = preset("tinyllama-mini");
  const MethodSpec fd{Method::kForwardDrop, collider::AttentionGrad::kExactQuery};  // attention_grad unused
  EXPECT_DOUBLE_EQ(forward_flops(c, 2, 512, 304, fd).total(), forward_drop_forward_flops(c, 2, 512, 304).total());
  EXPECT_DOUBLE_EQ(backward_flops(c, 2, 512, 304, fd).total(), forward_drop_backward_flops(c, 2, 512, 304).total());
  EXPECT_DOUBLE_EQ(backward_flops(c, 2, 512, 304, fd).total(), 2 * forward_flops(c, 2, 512, 304, fd).total());
  for (Method m : {Method::kRegular, Method::kLossOnly, Method::kCollider, Method::kMasked}) {
    EXPECT_DOUBLE_EQ(forward_flops(c, 2, 512, 304, MethodSpec{m}).total(), forward_flops(c, 2, 512).total());
  }
  // Its FLOP ideal against regular lies between 0 and Collider's (the first and the last layer
  // and the LM head stay dense in its backward).
  const double dense = backward_flops(c, 2, 512, 512, MethodSpec{}).total();
  const double ideal = 1 - backward_flops(c, 2, 512, 304, fd).total() / dense;
  const double collider_ideal = 1 - backward_flops(c, 2, 512, 304, MethodSpec{Method::kCollider}).total() / dense;
  EXPECT_GT(ideal, 0.0);
  EXPECT_LT(ideal, collider_ideal);
  EXPECT_THROW(backward_flops(c, 1, 16, 0, fd), std::invalid_argument);
  EXPECT_THROW(backward_flops(preset("tinyllama-debug"), 1, 16, 8, fd), std::invalid_argument);
}
