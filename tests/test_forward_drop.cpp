// Forward token dropping (CausalLM::forward(input_ids, middle_BN), the forward_drop method in the
// style of DeepSpeed's random-LTD): gradients of every parameter against a reference written on
// full-size tensors, on every family, eager and SDPA, two ratios, B = 3, T = 37. The reference
// never gathers: it runs the middle layers on all T tokens with the keys outside the subset
// masked out, then keeps the middle layers' output only at the subset's positions (torch::where)
// and layer 0's output elsewhere. A subset of every token gives the plain forward bit for bit.
// Run: OMP_NUM_THREADS=1 build/tests/test_forward_drop
// Legend: B batch, T sequence, N tokens the middle layers see, D hidden, V vocab.
#include "models/common/architecture.h"
#include "models/common/blocks.h"
#include "models/common/rotary.h"
#include "models/model.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace collider::models {

// The friend of CausalLMImpl (model.h) that gives this test the model's own modules.
struct ModelInternals {
  static detail::DecoderStackImpl& stack(CausalLMImpl& m) { return *m.model_; }
  static torch::Tensor head(CausalLMImpl& m, const torch::Tensor& x_BTD) {
    if (m.lm_head_) return m.lm_head_->forward(x_BTD);
    return torch::nn::functional::linear(x_BTD, m.model_->embed_tokens->weight);
  }
};

}  // namespace collider::models

using namespace collider::models;
namespace md = collider::models::detail;

namespace {

const std::vector<std::string> kPresets = {"tinyllama-debug", "qwen2.5-debug", "phi-1.5-debug"};

// The -debug preset with 4 decoder layers: layer 0 and 3 see every token, layers 1-2 the subset.
CausalLM four_layer_model(const std::string& preset_name, AttentionImpl attn) {
  ModelConfig c = preset(preset_name);
  c.num_layers = 4;
  return build_model(c, attn, /*seed=*/7);
}

// The full-size reference (eager): see the file comment.
torch::Tensor reference_logits(CausalLM& m, const torch::Tensor& ids_BT, const torch::Tensor& middle_BN) {
  auto& stack = ModelInternals::stack(*m);
  const int64_t B = ids_BT.size(0), T = ids_BT.size(1);
  const auto L = static_cast<int64_t>(stack.layers.size());
  auto x_BTD = stack.embed_tokens->forward(ids_BT);
  md::ForwardContext ctx;
  ctx.attn = AttentionImpl::kEager;
  auto causal_TT = torch::ones({T, T}, torch::kBool).triu(1);
  ctx.causal_mask_TT = causal_TT;
  std::tie(ctx.cos_TR, ctx.sin_TR) =
      md::rotary_tables(T, md::rotary_dim(m->config()), m->config().rope_theta, x_BTD.scalar_type(), x_BTD.device());
  auto in_BT = torch::zeros({B, T}, torch::kBool).scatter(1, middle_BN, true);
  // A query of the subset sees only the subset's earlier keys. A query outside it keeps its own
  // key too (its row would otherwise be all masked: NaN); its output is discarded below.
  auto eye_TT = torch::eye(T, torch::kBool);
  md::ForwardContext mid = ctx;
  mid.causal_mask_TT = (causal_TT.unsqueeze(0) | (~in_BT.unsqueeze(1) & ~eye_TT.unsqueeze(0))).unsqueeze(1);
  x_BTD = stack.layers[0]->forward(x_BTD, ctx);
  auto m_BTD = x_BTD;
  for (int64_t i = 1; i + 1 < L; ++i) m_BTD = stack.layers[i]->forward(m_BTD, mid);
  x_BTD = torch::where(in_BT.unsqueeze(-1), m_BTD, x_BTD);
  x_BTD = stack.layers[L - 1]->forward(x_BTD, ctx);
  return ModelInternals::head(*m, stack.final_norm->forward(x_BTD));
}

struct Run {
  torch::Tensor logits;
  std::vector<torch::Tensor> grads;
};

Run run(CausalLM& m, const torch::Tensor& ids_BT, const torch::Tensor& labels_BT,
        const std::function<torch::Tensor()>& forward) {
  m->zero_grad();
  Run r;
  r.logits = forward();
  // random-LTD trains on every token's loss: the last layer sees every token.
  token_losses(r.logits, labels_BT).mean().backward();
  for (auto& p : m->parameters()) r.grads.push_back(p.grad().defined() ? p.grad().clone() : torch::zeros_like(p));
  return r;
}

double max_rel(const torch::Tensor& a, const torch::Tensor& ref) {
  const double scale = ref.abs().max().item<double>();
  return (a - ref).abs().max().item<double>() / (scale > 0 ? scale : 1.0);
}

struct Inputs {
  torch::Tensor ids_BT, labels_BT;
};

Inputs inputs(const ModelConfig& c, int64_t B, int64_t T) {
  torch::manual_seed(11);
  auto ids = torch::randint(c.vocab_size, {B, T}, torch::kLong);
  auto labels = torch::randint(c.vocab_size, {B, T}, torch::kLong);
  return {ids, labels};
}

class ForwardDrop : public ::testing::TestWithParam<std::tuple<std::string, AttentionImpl, double>> {};

TEST_P(ForwardDrop, EveryParameterGradientMatchesTheFullSizeReference) {
  const auto& [name, attn, ratio] = GetParam();
  auto m = four_layer_model(name, attn);
  const int64_t B = 3, T = 37;
  const int64_t N = T - static_cast<int64_t>(ratio * T);
  auto in = inputs(m->config(), B, T);
  torch::Generator gen = at::detail::createCPUGenerator(5);
  auto middle_BN = random_middle_tokens(B, T, N, gen, torch::kCPU);
  ASSERT_EQ(middle_BN.sizes(), (std::vector<int64_t>{B, N}));

  auto dropped = run(m, in.ids_BT, in.labels_BT, [&] { return m->forward(in.ids_BT, middle_BN); });
  m->set_attention_impl(AttentionImpl::kEager);
  auto ref = run(m, in.ids_BT, in.labels_BT, [&] { return reference_logits(m, in.ids_BT, middle_BN); });
  EXPECT_LE(max_rel(dropped.logits, ref.logits), 1e-5);
  auto params = m->named_parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_LE(max_rel(dropped.grads[i], ref.grads[i]), 1e-4) << params[i].key();
    // Every parameter receives gradient (the middle layers from the subset's tokens).
    EXPECT_GT(ref.grads[i].abs().max().item<double>(), 0.0) << params[i].key();
  }
}

INSTANTIATE_TEST_SUITE_P(AllFamilies, ForwardDrop,
                         ::testing::Combine(::testing::ValuesIn(kPresets),
                                            ::testing::Values(AttentionImpl::kEager, AttentionImpl::kSdpa),
                                            ::testing::Values(0.25, 0.5)),
                         [](const auto& info) {
                           return fmt::format("{}_{}_{}",
                                              std::get<0>(info.param) == "tinyllama-debug" ? "llama"
                                              : std::get<0>(info.param) == "qwen2.5-debug" ? "qwen2"
                                                                                           : "phi",
                                              to_string(std::get<1>(info.param)),
                                              static_cast<int>(std::get<2>(info.param) * 100));
                         });

TEST(ForwardDropEdges, ASubsetOfEveryTokenGivesThePlainForwardBitForBit) {
  for (const auto& name : kPresets) {
    for (auto attn : {AttentionImpl::kEager, AttentionImpl::kSdpa}) {
      auto m = four_layer_model(name, attn);
      const int64_t B = 2, T = 13;
      auto in = inputs(m->config(), B, T);
      auto all_BN = torch::arange(T, torch::kLong).unsqueeze(0).expand({B, T}).contiguous();
      auto plain = run(m, in.ids_BT, in.labels_BT, [&] { return m->forward(in.ids_BT); });
      auto all = run(m, in.ids_BT, in.labels_BT, [&] { return m->forward(in.ids_BT, all_BN); });
      EXPECT_TRUE(torch::equal(plain.logits, all.logits)) << name;
      for (size_t i = 0; i < plain.grads.size(); ++i) EXPECT_TRUE(torch::equal(plain.grads[i], all.grads[i])) << name;
    }
  }
}

TEST(ForwardDropEdges, RandomMiddleTokensAreSortedDistinctAndSeeded) {
  torch::Generator g1 = at::detail::createCPUGenerator(3), g2 = at::detail::createCPUGenerator(3);
  auto a = random_middle_tokens(4, 50, 30, g1, torch::kCPU);
  auto b = random_middle_tokens(4, 50, 30, g2, torch::kCPU);
  EXPECT_TRUE(torch::equal(a, b));
  EXPECT_TRUE((a.slice(1, 1) > a.slice(1, 0, 29)).all().item<bool>());
  EXPECT_GE(a.min().item<int64_t>(), 0);
  EXPECT_LT(a.max().item<int64_t>(), 50);
  EXPECT_FALSE(torch::equal(a[0], a[1]));  // each row its own draw
  EXPECT_THROW(random_middle_tokens(2, 10, 11, g1, torch::kCPU), c10::Error);
}

TEST(ForwardDropEdges, BadSubsetsAndTooFewLayersAreRefusedWithWhatToDo) {
  auto m = four_layer_model("tinyllama-debug", AttentionImpl::kEager);
  const int64_t B = 2, T = 9;
  auto in = inputs(m->config(), B, T);
  auto expect_refusal = [&](const torch::Tensor& middle_BN, const std::string& words) {
    try {
      m->forward(in.ids_BT, middle_BN);
      ADD_FAILURE() << "accepted: " << words;
    } catch (const c10::Error& e) { EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what(); }
  };
  auto ok = torch::tensor({{0, 2, 5}, {1, 3, 8}}, torch::kLong);
  expect_refusal(ok.to(torch::kInt), "int64 [B, N]");
  expect_refusal(ok.slice(0, 0, 1), "int64 [B, N]");
  expect_refusal(torch::tensor({{0, 5, 2}, {1, 3, 8}}, torch::kLong), "strictly increasing");
  expect_refusal(torch::tensor({{0, 2, 2}, {1, 3, 8}}, torch::kLong), "strictly increasing");
  expect_refusal(torch::tensor({{0, 2, 9}, {1, 3, 8}}, torch::kLong), "must lie in [0, 9)");
  expect_refusal(torch::zeros({2, 0}, torch::kLong), "1 to T = 9");
  EXPECT_NO_THROW(m->forward(in.ids_BT, ok));

  auto two = build_model(preset("tinyllama-debug"), AttentionImpl::kEager);  // 2 decoder layers
  try {
    two->forward(in.ids_BT, ok);
    ADD_FAILURE() << "a 2-layer model accepted forward token dropping";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("at least 3 decoder layers"), std::string::npos) << e.what();
  }
}

}  // namespace
