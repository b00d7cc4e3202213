// GPU checks of Collider (label gpu; every test skips cleanly without a CUDA device):
// the rewritten backward on CUDA equals the explicit-attention oracle for the three families,
// eager and fused attention (flash / memory-efficient SDPA backward nodes replaced), both
// semantics; in bf16 autocast the filtered backward runs and stays close to the masked method; and
// forward_drop's Trainer step on CUDA equals its CPU step.
// Run: build/tests/test_gpu_collider   (on a GPU machine; scripts/device/run_gpu_checks.sh)
#include "../collider_test_util.h"
#include "../model_attention_oracle.h"

#include "harness/components/train_step.h"
#include "models/model.h"

#include <gtest/gtest.h>

using namespace collider;
using namespace collider::testing;

namespace {

#define SKIP_WITHOUT_CUDA() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device"

struct Case {
  std::string preset;
  AttentionGrad attention;
  bool sdpa;
};

// Readable parameter in CTest's listing (instead of a byte dump).
void PrintTo(const Case& c, std::ostream* os) {
  *os << c.preset << (c.sdpa ? " sdpa " : " eager ") << to_string(c.attention);
}

std::string name_of(const ::testing::TestParamInfo<Case>& info) {
  std::string p = info.param.preset;
  for (auto& ch : p)
    if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return p + (info.param.sdpa ? "_sdpa_" : "_eager_") + to_string(info.param.attention);
}

torch::Tensor loss_of(models::CausalLM& m, const torch::Tensor& idx, const torch::Tensor& labels,
                      const torch::Tensor& keep) {
  return models::masked_mean_loss(models::token_losses(m->forward(idx), labels), keep);
}

class GpuGrad : public ::testing::TestWithParam<Case> {};

TEST_P(GpuGrad, MatchesOracleOnCuda) {
  SKIP_WITHOUT_CUDA();
  const Case c = GetParam();
  torch::Device dev(torch::kCUDA);
  auto m = models::build_model(models::preset(c.preset),
                               c.sdpa ? models::AttentionImpl::kSdpa : models::AttentionImpl::kEager, 0);
  m->to(dev);
  const auto& cfg = m->config();
  Plan plan = trace_plan([&](int64_t B, int64_t T) {
    auto idx = torch::randint(cfg.vocab_size, {B, T}, torch::TensorOptions(dev).dtype(torch::kLong));
    return loss_of(m, idx, torch::randint(cfg.vocab_size, {B, T}, idx.options()),
                   torch::ones({B, T}, idx.options().dtype(torch::kBool)));
  });
  const int64_t B = 3, T = 97;
  torch::manual_seed(5);
  auto idx = torch::randint(cfg.vocab_size, {B, T}).to(dev);
  auto labels = torch::randint(cfg.vocab_size, {B, T}).to(dev);
  auto keep = random_keep(B, T, 0.5, 17).to(dev);

  zero_grads(*m);
  auto loss = loss_of(m, idx, labels, keep);
  filter_backward(loss, keep, plan, {c.attention});
  loss.backward();
  auto g_collider = grads_of(*m);

  m->set_attention_impl(models::AttentionImpl::kEager);
  set_attention_oracle(*m, AttentionOracle{keep, c.attention == AttentionGrad::kExactQuery});
  zero_grads(*m);
  loss_of(m, idx, labels, keep).backward();
  set_attention_oracle(*m, std::nullopt);
  std::string worst;
  // TF32 may be on for CUDA matmuls; the tolerance follows the baseline's own error.
  EXPECT_LE(max_rel_diff(g_collider, grads_of(*m), &worst), 2e-3) << "worst parameter: " << worst;
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const char* p : {"tinyllama-debug", "qwen2.5-debug", "phi-1.5-debug"})
    for (auto a : {AttentionGrad::kKeptOnly, AttentionGrad::kExactQuery})
      for (bool sdpa : {false, true}) out.push_back({p, a, sdpa});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Cuda, GpuGrad, ::testing::ValuesIn(cases()), name_of);

TEST(GpuBf16, FilteredBackwardCloseToMasked) {
  SKIP_WITHOUT_CUDA();
  torch::Device dev(torch::kCUDA);
  auto m = models::build_model(models::preset("tinyllama-debug"), models::AttentionImpl::kSdpa, 0);
  m->to(dev);
  const auto& cfg = m->config();
  auto build = [&](int64_t B, int64_t T, const torch::Tensor* keep_in) {
    harness::AutocastScope autocast(true);
    torch::manual_seed(3);
    auto idx = torch::randint(cfg.vocab_size, {B, T}).to(dev);
    auto labels = torch::randint(cfg.vocab_size, {B, T}).to(dev);
    auto keep = keep_in ? *keep_in : torch::ones({B, T}, idx.options().dtype(torch::kBool));
    return loss_of(m, idx, labels, keep);
  };
  Plan plan = trace_plan([&](int64_t B, int64_t T) { return build(B, T, nullptr); });
  auto keep = random_keep(2, 128, 0.4, 9).to(dev);
  for (auto a : {AttentionGrad::kKeptOnly, AttentionGrad::kExactQuery}) {
    zero_grads(*m);
    auto loss = build(2, 128, &keep);
    filter_backward(loss, keep, plan, {a});
    loss.backward();
    auto g = grads_of(*m);
    zero_grads(*m);
    auto loss_m = build(2, 128, &keep);
    mask_backward(loss_m, keep, plan, {a});
    loss_m.backward();
    EXPECT_LE(max_rel_diff(g, grads_of(*m)), 5e-2) << to_string(a);  // bf16 rounding differs by path
  }
}

// forward_drop's step on CUDA (its subset pinned and copied without a host sync, its positions
// then not re-checked) gives the CPU step's loss and gradients: the same subset (drawn on the
// CPU from the same seed), fp32, a 4-layer -debug model.
TEST(GpuForwardDrop, StepMatchesTheCpuStep) {
  SKIP_WITHOUT_CUDA();
  models::ModelConfig cfg = models::preset("tinyllama-debug");
  cfg.num_layers = 4;
  harness::StepConfig sc;
  sc.spec.method = harness::Method::kForwardDrop;
  sc.filter_ratio = 0.4;
  sc.grad_clip = 0;
  harness::Trainer cpu(models::build_model(cfg, models::AttentionImpl::kEager, 3), sc, torch::kCPU, 3);
  harness::Trainer gpu(models::build_model(cfg, models::AttentionImpl::kEager, 3), sc, torch::kCUDA, 3);
  torch::Generator gen = at::detail::createCPUGenerator(1);
  const harness::Batch batch = harness::random_batch(2, 64, cfg.vocab_size, gen, torch::kCPU);
  const auto rc = cpu.step(batch), rg = gpu.step(batch);
  EXPECT_EQ(rg.middle_tokens_per_seq, rc.middle_tokens_per_seq);
  EXPECT_NEAR(rg.loss, rc.loss, 1e-4);
  auto gg = grads_of(*gpu.model());
  for (auto& [name, g] : gg) g = g.cpu();
  EXPECT_LE(max_rel_diff(gg, grads_of(*cpu.model())), 1e-3);
}

}  // namespace
