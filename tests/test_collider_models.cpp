// Collider on the paper's three families and on Mixtral (a mixture of experts) (-debug presets): after filter_backward every parameter
// gradient equals the model-level oracle of DESIGN.md section 3 (max|diff| / max|ref| <= 1e-4,
// fp32), for both attention semantics, filter_ratio 0 / 0.25 / 0.5 / 0.9, batch 1 and 3,
// T 64 and 97; filter_ratio 0 equals regular; hidden-state gradients are [B, N, D] at every
// layer boundary; eager and fused (SDPA) attention both.
// Run: build/tests/test_collider_models
#include "collider_test_util.h"
#include "model_attention_oracle.h"

#include "models/model.h"

#include <gtest/gtest.h>

using namespace collider;
using namespace collider::testing;

namespace {

struct Case {
  std::string preset;
  AttentionGrad attention;
  double ratio;
  int64_t B, T;
  bool sdpa;
};

// Readable parameter in CTest's listing (instead of a byte dump).
void PrintTo(const Case& c, std::ostream* os) {
  *os << c.preset << (c.sdpa ? " sdpa " : " eager ") << to_string(c.attention) << " r=" << c.ratio << " B=" << c.B
      << " T=" << c.T;
}

std::string name_of(const ::testing::TestParamInfo<Case>& info) {
  const auto& c = info.param;
  std::string p = c.preset;
  for (auto& ch : p)
    if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return p + (c.sdpa ? "_sdpa_" : "_eager_") + to_string(c.attention) + "_r" +
         std::to_string(static_cast<int>(c.ratio * 100)) + "_B" + std::to_string(c.B) + "_T" + std::to_string(c.T);
}

// Shapes of hidden-state gradients seen at every boundary, recorded while g_record is set.
std::vector<std::pair<std::string, std::vector<int64_t>>> g_shapes;
bool g_record = false;

models::CausalLM make_model(const std::string& preset, bool sdpa) {
  auto m = models::build_model(models::preset(preset),
                               sdpa ? models::AttentionImpl::kSdpa : models::AttentionImpl::kEager, 0);
  m->set_boundary_hook([](const torch::Tensor& x, const std::string& name) {
    auto y = x.view_as(x);
    y.register_hook([name](torch::Tensor g) {
      if (g_record) g_shapes.emplace_back(name, g.sizes().vec());
    });
    return y;
  });
  return m;
}

torch::Tensor loss_of(models::CausalLM& m, const torch::Tensor& idx, const torch::Tensor& labels,
                      const torch::Tensor& keep) {
  return models::masked_mean_loss(models::token_losses(m->forward(idx), labels), keep);
}

class ModelGrad : public ::testing::TestWithParam<Case> {};

TEST_P(ModelGrad, MatchesOracle) {
  const Case c = GetParam();
  auto m = make_model(c.preset, c.sdpa);
  const auto& cfg = m->config();
  Plan plan = trace_plan([&](int64_t B, int64_t T) {
    auto idx = torch::randint(cfg.vocab_size, {B, T});
    return loss_of(m, idx, torch::randint(cfg.vocab_size, {B, T}), torch::ones({B, T}, torch::kBool));
  });
  torch::manual_seed(5);
  auto idx = torch::randint(cfg.vocab_size, {c.B, c.T});
  auto labels = torch::randint(cfg.vocab_size, {c.B, c.T});
  auto keep = random_keep(c.B, c.T, c.ratio, 17);
  const int64_t N = keep.sum(1)[0].item<int64_t>();

  g_shapes.clear();
  zero_grads(*m);
  auto loss = loss_of(m, idx, labels, keep);
  filter_backward(loss, keep, plan, {c.attention});
  g_record = true;  // the backward's own gradients (the check on first use runs backwards inside the call)
  loss.backward();
  g_record = false;
  auto g_collider = grads_of(*m);
  ASSERT_EQ(g_shapes.size(), static_cast<size_t>(cfg.num_layers + 2));  // embedding, layers, final_norm
  for (const auto& [name, shape] : g_shapes) {
    EXPECT_EQ(shape, (std::vector<int64_t>{c.B, N, cfg.hidden_size})) << name;
  }

  zero_grads(*m);
  auto loss_m = loss_of(m, idx, labels, keep);
  mask_backward(loss_m, keep, plan, {c.attention});
  loss_m.backward();
  auto g_masked = grads_of(*m);

  // The oracle is written for the explicit attention graph.
  m->set_attention_impl(models::AttentionImpl::kEager);
  set_attention_oracle(*m, AttentionOracle{keep, c.attention == AttentionGrad::kExactQuery});
  zero_grads(*m);
  loss_of(m, idx, labels, keep).backward();
  set_attention_oracle(*m, std::nullopt);
  auto g_oracle = grads_of(*m);

  std::string worst;
  EXPECT_LE(max_rel_diff(g_collider, g_oracle, &worst), 1e-4) << "worst parameter: " << worst;
  EXPECT_LE(max_rel_diff(g_masked, g_oracle, &worst), 1e-4) << "worst parameter: " << worst;
  if (c.ratio > 0) {  // not passing by accident: loss_only's gradient differs
    zero_grads(*m);
    loss_of(m, idx, labels, keep).backward();
    EXPECT_GT(max_rel_diff(g_oracle, grads_of(*m)), 1e-3);
  } else {  // filter_ratio 0 reproduces regular
    zero_grads(*m);
    loss_of(m, idx, labels, torch::ones_like(keep)).backward();
    EXPECT_LE(max_rel_diff(g_collider, grads_of(*m)), 1e-5);
  }
}

std::vector<Case> eager_cases() {
  std::vector<Case> out;
  for (const char* p : {"tinyllama-debug", "qwen2.5-debug", "phi-1.5-debug", "mixtral-debug"})
    for (auto a : {AttentionGrad::kKeptOnly, AttentionGrad::kExactQuery})
      for (double r : {0.0, 0.25, 0.5, 0.9})
        for (int64_t B : {1, 3})
          for (int64_t T : {64, 97}) out.push_back({p, a, r, B, T, false});
  return out;
}

std::vector<Case> sdpa_cases() {
  std::vector<Case> out;
  for (const char* p : {"tinyllama-debug", "qwen2.5-debug", "phi-1.5-debug", "mixtral-debug"})
    for (auto a : {AttentionGrad::kKeptOnly, AttentionGrad::kExactQuery})
      for (int64_t B : {1, 3}) out.push_back({p, a, 0.5, B, 97, true});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Eager, ModelGrad, ::testing::ValuesIn(eager_cases()), name_of);
INSTANTIATE_TEST_SUITE_P(Sdpa, ModelGrad, ::testing::ValuesIn(sdpa_cases()), name_of);

}  // namespace
