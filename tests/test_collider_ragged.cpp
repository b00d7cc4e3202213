// Ragged kept counts (RHO-1's batch_topk selection): rows keep different numbers of tokens, one
// row a single token, one all but one, one none. After filter_backward every parameter gradient
// equals the DESIGN.md section-3 oracle (max|diff| / max|ref| <= 1e-4) on the three families
// (-debug presets) and the GPT-2-style test model, both attention semantics, eager and SDPA,
// B = 3 and 4, T = 97; and a loss that does not mask its dropped positions is refused.
// The token-row GEMMs (x @ W of the projections, MLP and LM head) run on the packed kept rows
// (collider_core/src/edits/packed_rows.cpp), so these tests check that path against the oracle too.
// Eager attention cores run row by row (row_attention.h): every one is replaced, checked here.
// Run: build/tests/test_collider_ragged
#include "collider_test_util.h"
#include "gpt2_test_model.h"
#include "model_attention_oracle.h"

#include "models/model.h"

#include <gtest/gtest.h>

#include <set>

using namespace collider;
using namespace collider::testing;

namespace {

constexpr int64_t kT = 97;

// Row 0 keeps one token, row 1 all but one, row 2 none, row 3 (B = 4) a random 40%.
torch::Tensor very_unequal_keep(int64_t B, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto keep = torch::zeros({B, kT}, torch::kBool);
  keep[0][at::randint(kT, {1}, gen).item<int64_t>()] = true;
  keep[1].fill_(true);
  keep[1][at::randint(kT, {1}, gen).item<int64_t>()] = false;
  if (B > 3) keep[3] = at::rand({kT}, gen) < 0.4;
  return keep;
}

struct Case {
  std::string preset;  // "gpt2-test" for the model defined in the tests
  AttentionGrad attention;
  int64_t B;
  bool sdpa;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.preset << (c.sdpa ? " sdpa " : " eager ") << to_string(c.attention) << " B=" << c.B;
}

std::string name_of(const ::testing::TestParamInfo<Case>& info) {
  const auto& c = info.param;
  std::string p = c.preset;
  for (auto& ch : p)
    if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return p + (c.sdpa ? "_sdpa_" : "_eager_") + to_string(c.attention) + "_B" + std::to_string(c.B);
}

// One model behind the three gradients the test compares: Collider, mask_backward, the oracle.
struct Subject {
  std::function<torch::Tensor(const torch::Tensor&)> logits;       // idx [B, T] -> [B, T, V]
  std::function<void(std::optional<torch::Tensor>, bool)> oracle;  // set / clear the oracle attention
  torch::nn::Module* module;
  int64_t vocab;
};

// Nodes named `name` reachable from the loss.
int count_nodes(const torch::Tensor& loss, const std::string& name) {
  std::vector<torch::autograd::Node*> stack = {loss.grad_fn().get()};
  std::set<torch::autograd::Node*> seen;
  int n = 0;
  while (!stack.empty()) {
    auto* node = stack.back();
    stack.pop_back();
    if (!node || !seen.insert(node).second) continue;
    n += node->name() == name;
    for (const auto& e : node->next_edges()) stack.push_back(e.function.get());
  }
  return n;
}

// The plan of the small GPT-2 (vocabulary 97) under the masked mean loss that the single tests use.
Plan gpt2_plan(Gpt2& m) {
  return trace_plan([&](int64_t B, int64_t T) {
    return masked_ce(m->forward(torch::randint(97, {B, T})), torch::randint(97, {B, T}),
                     torch::ones({B, T}, torch::kBool));
  });
}

class RaggedGrad : public ::testing::TestWithParam<Case> {};

TEST_P(RaggedGrad, MatchesOracle) {
  const Case c = GetParam();
  std::shared_ptr<torch::nn::Module> holder;
  Subject s;
  models::CausalLM lm{nullptr};
  Gpt2 gpt2{nullptr};
  if (c.preset == "gpt2-test") {
    torch::manual_seed(0);
    gpt2 = Gpt2(97, 32, 4, 2, 128);
    gpt2->use_sdpa = c.sdpa;
    s.logits = [&](const torch::Tensor& idx) { return gpt2->forward(idx); };
    s.oracle = [&](std::optional<torch::Tensor> keep, bool exact) {
      if (keep)
        gpt2->oracle = AttentionOracle{*keep, exact};
      else
        gpt2->oracle.reset();
    };
    s.module = gpt2.get();
    s.vocab = 97;
  } else {
    lm = models::build_model(models::preset(c.preset),
                             c.sdpa ? models::AttentionImpl::kSdpa : models::AttentionImpl::kEager, 0);
    s.logits = [&](const torch::Tensor& idx) { return lm->forward(idx); };
    s.oracle = [&](std::optional<torch::Tensor> keep, bool exact) {
      if (keep) {
        lm->set_attention_impl(models::AttentionImpl::kEager);  // the oracle is written for the explicit graph
        set_attention_oracle(*lm, AttentionOracle{*keep, exact});
      } else {
        set_attention_oracle(*lm, std::nullopt);
        lm->set_attention_impl(c.sdpa ? models::AttentionImpl::kSdpa : models::AttentionImpl::kEager);
      }
    };
    s.module = lm.get();
    s.vocab = lm->config().vocab_size;
  }
  Plan plan = trace_plan([&](int64_t B, int64_t T) {
    return masked_ce(s.logits(torch::randint(s.vocab, {B, T})), torch::randint(s.vocab, {B, T}),
                     torch::ones({B, T}, torch::kBool));
  });
  torch::manual_seed(9);
  auto idx = torch::randint(s.vocab, {c.B, kT});
  auto labels = torch::randint(s.vocab, {c.B, kT});
  auto keep = very_unequal_keep(c.B, 23);

  zero_grads(*s.module);
  auto loss = masked_ce(s.logits(idx), labels, keep);
  FilterStats st = filter_backward(loss, keep, plan, {c.attention});
  // Eager attention cores run row by row (row_attention.h), every one of them: no softmax
  // backward is left in the graph.
  if (!c.sdpa) {
    EXPECT_GT(count_nodes(loss, "collider::RowAttention"), 0);
    EXPECT_EQ(count_nodes(loss, "SoftmaxBackward0"), 0);
  }
  loss.backward();
  auto g_collider = grads_of(*s.module);
  EXPECT_EQ(st.kept, kT - 1);  // rows are cut to the largest count
  EXPECT_EQ(st.kept_min, 0);
  EXPECT_EQ(st.kept_max, kT - 1);
  EXPECT_EQ(st.kept_total, keep.sum().item<int64_t>());
  EXPECT_GT(st.gemms_packed, 0) << "the token-row GEMMs run on the packed kept rows";

  zero_grads(*s.module);
  auto loss_m = masked_ce(s.logits(idx), labels, keep);
  mask_backward(loss_m, keep, plan, {c.attention});
  loss_m.backward();
  auto g_masked = grads_of(*s.module);

  zero_grads(*s.module);
  s.oracle(keep, c.attention == AttentionGrad::kExactQuery);
  masked_ce(s.logits(idx), labels, keep).backward();
  s.oracle(std::nullopt, false);
  auto g_oracle = grads_of(*s.module);

  zero_grads(*s.module);
  masked_ce(s.logits(idx), labels, keep).backward();
  EXPECT_GT(max_rel_diff(g_oracle, grads_of(*s.module)), 1e-3);  // loss_only differs: no pass by accident

  std::string worst;
  EXPECT_LE(max_rel_diff(g_collider, g_oracle, &worst), 1e-4) << "worst parameter: " << worst;
  EXPECT_LE(max_rel_diff(g_masked, g_oracle, &worst), 1e-4) << "worst parameter: " << worst;
}

std::vector<Case> all_cases() {
  std::vector<Case> out;
  for (const char* p : {"tinyllama-debug", "qwen2.5-debug", "phi-1.5-debug", "gpt2-test"})
    for (auto a : {AttentionGrad::kKeptOnly, AttentionGrad::kExactQuery})
      for (bool sdpa : {false, true})
        for (int64_t B : {3, 4}) out.push_back({p, a, B, sdpa});
  return out;
}

INSTANTIATE_TEST_SUITE_P(BatchTopK, RaggedGrad, ::testing::ValuesIn(all_cases()), name_of);

// The cut rows of a ragged mask include dropped positions as padding. A loss that does not mask the
// dropped positions (the mean over every position) is refused before the graph is touched: filtering
// would drop their terms silently. A plain backward afterwards is the dense one.
TEST(RaggedCollider, UnmaskedLossIsRefused) {
  torch::manual_seed(0);
  Gpt2 m(97, 32, 4, 2, 128);
  Plan plan = gpt2_plan(m);
  auto idx = torch::randint(97, {3, kT});
  auto labels = torch::randint(97, {3, kT});
  auto keep = very_unequal_keep(3, 29);
  const auto all = torch::ones_like(keep);
  zero_grads(*m);
  masked_ce(m->forward(idx), labels, all).backward();
  auto dense = grads_of(*m);
  for (auto a : {AttentionGrad::kKeptOnly, AttentionGrad::kExactQuery}) {
    zero_grads(*m);
    auto loss = masked_ce(m->forward(idx), labels, all);
    auto msg = error_of([&] { filter_backward(loss, keep, plan, {a}); });
    EXPECT_NE(msg.find("the loss counts positions the keep mask drops"), std::string::npos) << msg;
    loss.backward();
    EXPECT_EQ(max_rel_diff(grads_of(*m), dense), 0.0) << to_string(a);
  }
}

// Equal counts take the per-sequence path: no padding, and the gradient bit for bit that of
// the same mask cut without any ragged bookkeeping.
TEST(RaggedCollider, EqualCountsArePerSequence) {
  torch::manual_seed(0);
  Gpt2 m(97, 32, 4, 2, 128);
  Plan plan = gpt2_plan(m);
  auto idx = torch::randint(97, {3, kT});
  auto labels = torch::randint(97, {3, kT});
  auto scores = torch::rand({3, kT});
  SelectOptions per_sequence;
  per_sequence.align = 1;
  auto keep = select_tokens(scores, 0.4, per_sequence);
  std::map<std::string, torch::Tensor> first;
  for (int run = 0; run < 2; ++run) {
    zero_grads(*m);
    auto loss = masked_ce(m->forward(idx), labels, keep);
    FilterStats st = filter_backward(loss, keep, plan, {AttentionGrad::kExactQuery});
    loss.backward();
    EXPECT_EQ(st.kept_min, st.kept_max);
    EXPECT_EQ(st.kept_total, 3 * st.kept);
    EXPECT_EQ(st.gemms_packed, 0) << "no padding: the per-sequence path";
    auto g = grads_of(*m);
    if (run == 0) first = g;
    for (const auto& [name, t] : first) EXPECT_TRUE(torch::equal(t, g.at(name))) << name;
  }
}


// The row-by-row attention cores cut their rows when the backward first reaches them (as every
// saved tensor is cut, saved_cut.h). A backward with retain_graph keeps those rows: a second
// backward gives the same gradient bit for bit; a third, after one that did not retain the graph,
// is refused with advice.
TEST(RaggedCollider, RowAttentionCutsInTheBackwardAndKeepsARetainedGraph) {
  torch::manual_seed(0);
  Gpt2 m(97, 32, 4, 2, 128);
  Plan plan = gpt2_plan(m);
  auto idx = torch::randint(97, {4, kT});
  auto labels = torch::randint(97, {4, kT});
  auto keep = very_unequal_keep(4, 31);
  for (auto a : {AttentionGrad::kKeptOnly, AttentionGrad::kExactQuery}) {
    zero_grads(*m);
    auto loss = masked_ce(m->forward(idx), labels, keep);
    FilterStats st = filter_backward(loss, keep, plan, {a});
    EXPECT_GT(count_nodes(loss, "collider::RowAttention"), 0) << to_string(a);
    EXPECT_GT(st.tensors_gathered, 0);
    loss.backward({}, /*retain_graph=*/true);
    auto first = grads_of(*m);
    zero_grads(*m);
    loss.backward();
    auto second = grads_of(*m);
    for (const auto& [name, t] : first) EXPECT_TRUE(torch::equal(t, second.at(name))) << name << " " << to_string(a);
    auto msg = error_of([&] { loss.backward(); });
    EXPECT_NE(msg.find("a second time"), std::string::npos) << msg;
  }
}

}  // namespace
