// Collider on a language model built from libtorch's own torch::nn::TransformerEncoderLayer:
// code nobody here wrote, sequence-first ([T, B, D] activations, flattened to [T*B, D] rows
// inside nn::MultiheadAttention and the feed-forward linears), post-norm, causal float mask.
// The oracle re-states the same layer with the module's own parameters (checked to give the
// same loss) and the DESIGN.md section-3 semantics: dropped tokens' K and V detached
// (exact_query), or P restricted to kept rows and columns (kept_only).
// Legend: B batch, T sequence, D hidden, H heads, E head-dim, F ffn, V vocab.
// Run: build/tests/test_core_torch_nn
#include "collider_test_util.h"
#include "gpt2_test_model.h"

#include <gtest/gtest.h>

using namespace collider;
using namespace collider::testing;
namespace F = torch::nn::functional;

namespace {

constexpr int64_t kVocab = 89, kDim = 32, kHeads = 4, kFfn = 48, kLayers = 2;

struct SeqFirstLmImpl : torch::nn::Module {
  torch::nn::Embedding emb{nullptr};
  std::vector<torch::nn::TransformerEncoderLayer> layers;
  torch::nn::Linear head{nullptr};
  std::optional<AttentionOracle> oracle;  // set: run the hand-written layer with these semantics

  SeqFirstLmImpl() {
    emb = register_module("emb", torch::nn::Embedding(kVocab, kDim));
    for (int64_t l = 0; l < kLayers; ++l) {
      layers.push_back(register_module(
          "layer" + std::to_string(l),
          torch::nn::TransformerEncoderLayer(
              torch::nn::TransformerEncoderLayerOptions(kDim, kHeads).dim_feedforward(kFfn).dropout(0.0))));
    }
    head = register_module("head", torch::nn::Linear(kDim, kVocab));
  }

  // The oracle's layer: what TransformerEncoderLayer computes (post-norm, ReLU), written out.
  torch::Tensor oracle_layer(torch::nn::TransformerEncoderLayer& layer, const torch::Tensor& x_TBD,
                             const torch::Tensor& mask_TT) {
    const int64_t T = x_TBD.size(0), B = x_TBD.size(1), E = kDim / kHeads;
    auto& mha = layer->self_attn;
    auto qkv = F::linear(x_TBD, mha->in_proj_weight, mha->in_proj_bias).chunk(3, -1);
    auto heads = [&](const torch::Tensor& t) { return t.reshape({T, B, kHeads, E}).permute({1, 2, 0, 3}); };
    auto q = heads(qkv[0]), k = heads(qkv[1]), v = heads(qkv[2]);  // [B, H, T, E]
    torch::Tensor o_BHTE;
    if (!oracle->exact_query) {
      o_BHTE = KeptOnlyAttention::apply(q, k, v, oracle->keep_BT.to(x_TBD.scalar_type()).view({B, 1, T, 1}));
    } else {
      auto keep = oracle->keep_BT.view({B, 1, T, 1});
      k = torch::where(keep, k, k.detach());
      v = torch::where(keep, v, v.detach());
      auto s = q.matmul(k.transpose(-2, -1)) / std::sqrt(static_cast<double>(E)) + mask_TT;
      o_BHTE = torch::softmax(s, -1).matmul(v);
    }
    auto attn = mha->out_proj->forward(o_BHTE.permute({2, 0, 1, 3}).reshape({T, B, kDim}));
    auto h = layer->norm1->forward(x_TBD + attn);
    return layer->norm2->forward(h + layer->linear2->forward(torch::relu(layer->linear1->forward(h))));
  }

  torch::Tensor forward(const torch::Tensor& idx_BT) {
    const int64_t T = idx_BT.size(1);
    auto x_TBD = emb->forward(idx_BT).transpose(0, 1);
    auto mask_TT = torch::full({T, T}, -INFINITY, x_TBD.options()).triu(1);
    for (auto& layer : layers) x_TBD = oracle ? oracle_layer(layer, x_TBD, mask_TT) : layer->forward(x_TBD, mask_TT);
    return head->forward(x_TBD).transpose(0, 1);  // [B, T, V]
  }
};
TORCH_MODULE(SeqFirstLm);

SeqFirstLm make_model() {
  torch::manual_seed(0);
  SeqFirstLm m;
  m->to(torch::kDouble);
  m->train();
  return m;
}

Plan make_plan(SeqFirstLm& m) {
  return trace_plan([&](int64_t B, int64_t T) {
    auto idx = torch::randint(kVocab, {B, T});
    auto labels = torch::randint(kVocab, {B, T});
    return masked_ce(m->forward(idx), labels, torch::ones({B, T}, torch::kBool));
  });
}

using Case = GradCase;

class TorchNnEncoderGrad : public ::testing::TestWithParam<Case> {};

TEST_P(TorchNnEncoderGrad, MatchesOracle) {
  const Case c = GetParam();
  SeqFirstLm m = make_model();
  Plan plan = make_plan(m);
  torch::manual_seed(3);
  auto idx = torch::randint(kVocab, {c.B, c.T});
  auto labels = torch::randint(kVocab, {c.B, c.T});
  auto keep = random_keep(c.B, c.T, c.ratio, 13);

  zero_grads(*m);
  auto loss = masked_ce(m->forward(idx), labels, keep);
  const double loss_module = loss.item<double>();
  FilterStats st = filter_backward(loss, keep, plan, {c.attention});
  loss.backward();
  auto g_collider = grads_of(*m);
  EXPECT_EQ(st.kept, keep.sum(1)[0].item<int64_t>());
  EXPECT_GT(st.tensors_gathered, 0);

  zero_grads(*m);
  auto loss_m = masked_ce(m->forward(idx), labels, keep);
  mask_backward(loss_m, keep, plan, {c.attention});
  loss_m.backward();
  auto g_masked = grads_of(*m);

  zero_grads(*m);
  m->oracle = AttentionOracle{keep, c.attention == AttentionGrad::kExactQuery};
  auto loss_o = masked_ce(m->forward(idx), labels, keep);
  m->oracle.reset();
  EXPECT_NEAR(loss_o.item<double>(), loss_module, 1e-10) << "the oracle's layer is not the module's layer";
  loss_o.backward();
  auto g_oracle = grads_of(*m);

  zero_grads(*m);
  masked_ce(m->forward(idx), labels, keep).backward();
  auto g_loss_only = grads_of(*m);
  EXPECT_GT(max_rel_diff(g_oracle, g_loss_only), 1e-3);  // the comparisons below cannot pass by accident

  std::string worst;
  EXPECT_LE(max_rel_diff(g_collider, g_oracle, &worst), 1e-4) << "worst parameter: " << worst;
  EXPECT_LE(max_rel_diff(g_masked, g_oracle, &worst), 1e-4) << "worst parameter: " << worst;
}

std::vector<Case> all_cases() {
  std::vector<Case> out;
  for (auto a : {AttentionGrad::kKeptOnly, AttentionGrad::kExactQuery})
    for (double r : {0.25, 0.5})
      for (int64_t B : {1, 3}) out.push_back({a, r, B, 37});
  return out;
}

INSTANTIATE_TEST_SUITE_P(SequenceFirst, TorchNnEncoderGrad, ::testing::ValuesIn(all_cases()), grad_case_name);

TEST(TorchNnEncoder, PlanFindsAttentionCoresAndSequenceFirstRows) {
  SeqFirstLm m = make_model();
  Plan plan = make_plan(m);
  EXPECT_NE(plan.summary().find("2 attention cores"), std::string::npos) << plan.summary();
  EXPECT_NE(plan.summary().find("exact_query available"), std::string::npos) << plan.summary();
  // Both row orders occur: [T*B, D] inside the layers, [B*T, V] in the loss.
  const std::string text = plan.to_string();
  EXPECT_NE(text.find(":3:"), std::string::npos) << "no sequence-first flattened dimension in the plan";
  EXPECT_NE(text.find(":1:"), std::string::npos) << "no batch-first flattened dimension in the plan";
  Plan back = Plan::from_string(text);
  EXPECT_EQ(back.to_string(), text);
}

TEST(TorchNnEncoder, RatioZeroEqualsRegular) {
  SeqFirstLm m = make_model();
  expect_ratio_zero_equals_regular(m, make_plan(m), kVocab, 2, 29, 1e-10);
}

}  // namespace
