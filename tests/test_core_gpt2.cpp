// Collider on a model the library has never seen: a GPT-2-style block defined in the tests.
// Parameter gradients after filter_backward must equal the DESIGN.md section-3 oracles (and
// mask_backward) for both attention semantics, several filter ratios, batch 1 and 3, T 64 and 97.
// Run: build/tests/test_core_gpt2
#include "collider_test_util.h"
#include "gpt2_test_model.h"

#include <gtest/gtest.h>

using namespace collider;
using namespace collider::testing;

namespace {

constexpr int64_t kVocab = 97, kDim = 32, kHeads = 4, kLayers = 2, kMaxT = 128;

// Every block's output passes through an identity view whose gradient shape is recorded while
// `record` is set (the graph must be the same when tracing and when filtering).
std::vector<std::vector<int64_t>> g_grad_shapes;
bool g_record = false;

Gpt2 make_model() {
  torch::manual_seed(0);
  Gpt2 m(kVocab, kDim, kHeads, kLayers, kMaxT);
  m->hook = [](const torch::Tensor& x, int) {
    auto y = x.view_as(x);
    y.register_hook([](torch::Tensor g) {
      if (g_record) g_grad_shapes.push_back(g.sizes().vec());
    });
    return y;
  };
  return m;
}

Plan make_plan(Gpt2& m) {
  return trace_plan([&](int64_t B, int64_t T) {
    auto idx = torch::randint(kVocab, {B, T});
    auto labels = torch::randint(kVocab, {B, T});
    return masked_ce(m->forward(idx), labels, torch::ones({B, T}, torch::kBool));
  });
}

using Case = GradCase;

// Gradients of one batch by the masked method (library, full-size zero-masked tensors), the
// model-level oracle, and loss_only (plain autograd on the masked loss).
struct ReferenceGrads {
  std::map<std::string, torch::Tensor> masked, oracle, loss_only;
};

ReferenceGrads reference_grads(Gpt2& m, const Plan& plan, const torch::Tensor& idx, const torch::Tensor& labels,
                               const torch::Tensor& keep, AttentionGrad attention) {
  ReferenceGrads out;
  zero_grads(*m);
  auto loss_m = masked_ce(m->forward(idx), labels, keep);
  mask_backward(loss_m, keep, plan, {attention});
  loss_m.backward();
  out.masked = grads_of(*m);
  zero_grads(*m);
  m->oracle = AttentionOracle{keep, attention == AttentionGrad::kExactQuery};
  masked_ce(m->forward(idx), labels, keep).backward();
  m->oracle.reset();
  out.oracle = grads_of(*m);
  zero_grads(*m);
  masked_ce(m->forward(idx), labels, keep).backward();
  out.loss_only = grads_of(*m);
  return out;
}

class Gpt2Grad : public ::testing::TestWithParam<Case> {};

TEST_P(Gpt2Grad, MatchesOracle) {
  const Case c = GetParam();
  Gpt2 m = make_model();
  Plan plan = make_plan(m);
  torch::manual_seed(1);
  auto idx = torch::randint(kVocab, {c.B, c.T});
  auto labels = torch::randint(kVocab, {c.B, c.T});
  auto keep = random_keep(c.B, c.T, c.ratio, 7);
  const int64_t N = keep.sum(1)[0].item<int64_t>();

  // Collider: hooks see hidden-state gradients of [B, N, D] after every block.
  // (Recorded from the backward itself: the check on first use runs its own backwards inside filter_backward.)
  g_grad_shapes.clear();
  zero_grads(*m);
  auto loss = masked_ce(m->forward(idx), labels, keep);
  FilterStats st = filter_backward(loss, keep, plan, {c.attention});
  g_record = true;
  loss.backward();
  auto g_collider = grads_of(*m);
  g_record = false;
  auto grad_shapes = g_grad_shapes;
  EXPECT_EQ(st.kept, N);
  if (N < c.T) {
    EXPECT_GT(st.tensors_gathered, 0);  // with every token kept only broadcast tensors are copied
  }
  ASSERT_EQ(grad_shapes.size(), static_cast<size_t>(kLayers));
  for (const auto& s : grad_shapes) EXPECT_EQ(s, (std::vector<int64_t>{c.B, N, kDim}));

  // loss_only differs once tokens are dropped, so the comparisons below cannot pass by accident
  // with a rewrite that changes nothing.
  auto ref = reference_grads(m, plan, idx, labels, keep, c.attention);
  const auto& g_oracle = ref.oracle;
  const auto& g_masked = ref.masked;
  if (c.ratio > 0) { EXPECT_GT(max_rel_diff(g_oracle, ref.loss_only), 1e-3); }

  std::string worst;
  EXPECT_LE(max_rel_diff(g_collider, g_oracle, &worst), 1e-4) << "worst parameter: " << worst;
  EXPECT_LE(max_rel_diff(g_masked, g_oracle, &worst), 1e-4) << "worst parameter: " << worst;
}

std::vector<Case> all_cases() {
  std::vector<Case> out;
  for (auto a : {AttentionGrad::kKeptOnly, AttentionGrad::kExactQuery})
    for (double r : {0.0, 0.25, 0.5, 0.9})
      for (int64_t B : {1, 3})
        for (int64_t T : {64, 97}) out.push_back({a, r, B, T});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Semantics, Gpt2Grad, ::testing::ValuesIn(all_cases()), grad_case_name);

// Fused attention: the SDPA backward node is replaced by one computing the chosen semantics.
class Gpt2SdpaGrad : public ::testing::TestWithParam<Case> {};

// Collider's gradient of one batch against the oracle and the masked method, for a model
// variant set up by the caller (fused attention, an empty KV cache).
void expect_matches_oracle(Gpt2& m, const Case& c, uint64_t seed) {
  Plan plan = make_plan(m);
  torch::manual_seed(seed);
  auto idx = torch::randint(kVocab, {c.B, c.T});
  auto labels = torch::randint(kVocab, {c.B, c.T});
  auto keep = random_keep(c.B, c.T, c.ratio, seed + 9);
  zero_grads(*m);
  auto loss = masked_ce(m->forward(idx), labels, keep);
  filter_backward(loss, keep, plan, {c.attention});
  loss.backward();
  auto g_collider = grads_of(*m);
  auto ref = reference_grads(m, plan, idx, labels, keep, c.attention);
  if (c.ratio > 0) { EXPECT_GT(max_rel_diff(ref.oracle, ref.loss_only), 1e-3); }
  std::string worst;
  EXPECT_LE(max_rel_diff(g_collider, ref.oracle, &worst), 1e-4) << "worst parameter: " << worst;
  EXPECT_LE(max_rel_diff(ref.masked, ref.oracle, &worst), 1e-4) << "worst parameter: " << worst;
}

TEST_P(Gpt2SdpaGrad, MatchesOracle) {
  Gpt2 m = make_model();
  m->use_sdpa = true;
  expect_matches_oracle(m, GetParam(), 2);
}

std::vector<Case> sdpa_cases() {
  std::vector<Case> out;
  for (auto a : {AttentionGrad::kKeptOnly, AttentionGrad::kExactQuery})
    for (double r : {0.0, 0.5})
      for (int64_t B : {1, 3}) out.push_back({a, r, B, 97});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Fused, Gpt2SdpaGrad, ::testing::ValuesIn(sdpa_cases()), grad_case_name);

TEST(Gpt2Collider, RatioZeroEqualsRegular) {
  Gpt2 m = make_model();
  expect_ratio_zero_equals_regular(m, make_plan(m), kVocab, 2, 40, 1e-6);
}

TEST(Gpt2Collider, PlanFindsAttentionCores) {
  Gpt2 m = make_model();
  Plan plan = make_plan(m);
  EXPECT_NE(plan.summary().find("2 attention cores"), std::string::npos) << plan.summary();
  EXPECT_NE(plan.summary().find("exact_query available"), std::string::npos) << plan.summary();
}

// K and V concatenated onto an empty KV cache (transformers with use_cache left on): the
// concatenation keeps every position in place, so it is rewritten like a token-wise op.
class Gpt2EmptyCacheGrad : public ::testing::TestWithParam<Case> {};

TEST_P(Gpt2EmptyCacheGrad, MatchesOracle) {
  Gpt2 m = make_model();
  m->empty_kv_cache = true;
  expect_matches_oracle(m, GetParam(), 4);
}

std::vector<Case> cache_cases() {
  std::vector<Case> out;
  for (auto a : {AttentionGrad::kKeptOnly, AttentionGrad::kExactQuery})
    for (int64_t B : {1, 3}) out.push_back({a, 0.5, B, 97});
  return out;
}

INSTANTIATE_TEST_SUITE_P(KvCache, Gpt2EmptyCacheGrad, ::testing::ValuesIn(cache_cases()), grad_case_name);

// All or nothing: a refusal met deep in the graph leaves the graph as the forward built it, so a
// plain backward still gives the loss_only gradient. The refusal: a plan whose last field (the
// embedding's, last in breadth-first order, reached after every layer was prepared) says another
// rank than the graph's, as a stale plan text would.
TEST(Gpt2Collider, RefusalDeepInTheGraphLeavesItUnchanged) {
  Gpt2 m = make_model();
  m->use_sdpa = true;
  std::string text = make_plan(m).to_string();
  const size_t second_variant = text.find("collider-plan", 1);
  const size_t line = text.rfind("\nfield ", second_variant) + 1;  // "field <name> <kind> <item> <rank> ..."
  size_t rank_at = line;
  for (int word = 0; word < 4; ++word) rank_at = text.find(' ', rank_at) + 1;
  text.replace(rank_at, 1, std::string(1, static_cast<char>(text[rank_at] + 1)));
  Plan plan = Plan::from_string(text);
  torch::manual_seed(5);
  auto idx = torch::randint(kVocab, {3, 40});
  auto labels = torch::randint(kVocab, {3, 40});
  auto keep = random_keep(3, 40, 0.5, 19);
  for (auto a : {AttentionGrad::kKeptOnly, AttentionGrad::kExactQuery}) {
    zero_grads(*m);
    masked_ce(m->forward(idx), labels, keep).backward();
    auto g_loss_only = grads_of(*m);
    zero_grads(*m);
    auto loss = masked_ce(m->forward(idx), labels, keep);
    try {
      filter_backward(loss, keep, plan, {a});
      FAIL() << "filter_backward accepted a graph that does not match its plan";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("does not match the plan"), std::string::npos) << e.what();
    }
    loss.backward();
    EXPECT_LE(max_rel_diff(grads_of(*m), g_loss_only), 1e-6) << to_string(a);
  }
}

// A fused attention given an explicit causal mask instead of is_causal: the mask is cut with the
// scores, so the filtered gradient is the one of is_causal.
TEST(Gpt2Collider, ExplicitMaskEqualsIsCausal) {
  Gpt2 m = make_model();
  m->use_sdpa = true;
  Plan plan = make_plan(m);
  torch::manual_seed(5);
  auto idx = torch::randint(kVocab, {3, 97});
  auto labels = torch::randint(kVocab, {3, 97});
  auto keep = random_keep(3, 97, 0.5, 19);
  for (auto a : {AttentionGrad::kKeptOnly, AttentionGrad::kExactQuery}) {
    m->explicit_mask_layer = -1;
    zero_grads(*m);
    auto loss = masked_ce(m->forward(idx), labels, keep);
    filter_backward(loss, keep, plan, {a});
    loss.backward();
    auto g_causal = grads_of(*m);
    m->explicit_mask_layer = 1;
    zero_grads(*m);
    loss = masked_ce(m->forward(idx), labels, keep);
    filter_backward(loss, keep, plan, {a});
    loss.backward();
    EXPECT_LE(max_rel_diff(grads_of(*m), g_causal), 1e-5) << to_string(a);
  }
}

}  // namespace
