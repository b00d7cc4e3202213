// Collider with every saved tensor behind saved-tensor hooks whose unpack returns a new tensor (a
// clone: what recomputation under activation checkpointing and copying back from an offload do).
// Such a tensor exists only while the backward runs; Collider cuts it when it is unpacked
// (collider_core/src/saved_cut.h). A cut cached by the address of a tensor that died gave wrong
// gradients from run to run here, so each case runs on 8 fresh models. After filter_backward every
// parameter gradient equals the model-level oracle of DESIGN.md section 3 (max|diff| / max|ref|
// <= 1e-4, fp32) on the four families (-debug presets; Mixtral's routes behind the hooks run on all
// their rows, collider_core/src/routes.h), eager and SDPA, both semantics, B = 3, T = 97,
// per-sequence and ragged (batch_topk-like) masks. The Python set-ups (checkpointing in
// transformers, save_on_cpu, LoRA) are python/tests/test_checkpointing.py.
// Run: build/tests/test_collider_saved_hooks
#include "../collider_core/src/node_fields.h"
#include "collider_test_util.h"
#include "model_attention_oracle.h"

#include "models/model.h"
#include "collider/torch_compat.h"

#include <torch/csrc/autograd/saved_variable_hooks.h>

#include <gtest/gtest.h>

#include <unordered_set>

using namespace collider;
using namespace collider::testing;

namespace {

// Keeps the packed tensor; every unpack hands out a fresh copy of it.
class CloneOnUnpack final : public torch::autograd::SavedVariableHooks {
 public:
  void call_pack_hook(const at::Tensor& t) override { packed_ = t; }
  at::Tensor call_unpack_hook() override { return packed_.clone(); }

 private:
  at::Tensor packed_;
};

// Puts every saved tensor of the graph behind CloneOnUnpack.
class HookEverySaved final : public collider::detail::IgnoringFieldVisitor {
 public:
  int hooked = 0;
  void saved(const char*, torch::autograd::SavedVariable& v) override { hook(v); }
  void saved_list(const char*, std::vector<torch::autograd::SavedVariable>& vs) override {
    for (auto& v : vs) hook(v);
  }

 private:
  void hook(torch::autograd::SavedVariable& v) {
    auto raw = v.get_raw_data();
    if (v.has_hooks() || !raw || !raw->defined()) return;
    v.register_hooks(std::make_unique<CloneOnUnpack>());
    ++hooked;
  }
};

int hook_every_saved_tensor(const torch::Tensor& loss) {
  HookEverySaved visitor;
  std::unordered_set<torch::autograd::Node*> seen;
  std::vector<NodePtr> stack = {loss.grad_fn()};
  while (!stack.empty()) {
    auto n = stack.back();
    stack.pop_back();
    if (!n || !seen.insert(n.get()).second) continue;
    if (const auto* f = collider::detail::find_node_fields(*n)) f->visit(n.get(), visitor);
    for (const auto& e : n->next_edges()) stack.push_back(e.function);
  }
  return visitor.hooked;
}

struct Case {
  std::string preset;
  AttentionGrad attention;
  bool sdpa, ragged;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.preset << (c.sdpa ? " sdpa " : " eager ") << to_string(c.attention) << (c.ragged ? " ragged" : "");
}

std::string name_of(const ::testing::TestParamInfo<Case>& info) {
  std::string p = info.param.preset;
  for (auto& ch : p)
    if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return p + (info.param.sdpa ? "_sdpa_" : "_eager_") + to_string(info.param.attention) +
         (info.param.ragged ? "_ragged" : "");
}

torch::Tensor loss_of(models::CausalLM& m, const torch::Tensor& idx, const torch::Tensor& labels,
                      const torch::Tensor& keep) {
  return models::masked_mean_loss(models::token_losses(m->forward(idx), labels), keep);
}

class SavedHooksGrad : public ::testing::TestWithParam<Case> {};

TEST_P(SavedHooksGrad, CloneOnUnpackMatchesOracleOnFreshModels) {
  const Case c = GetParam();
  constexpr int64_t B = 3, T = 97;
  for (int run = 0; run < 8; ++run) {
    auto m = models::build_model(models::preset(c.preset),
                                 c.sdpa ? models::AttentionImpl::kSdpa : models::AttentionImpl::kEager, run);
    const auto& cfg = m->config();
    Plan plan = trace_plan([&](int64_t b, int64_t t) {
      auto idx = torch::randint(cfg.vocab_size, {b, t});
      return loss_of(m, idx, torch::randint(cfg.vocab_size, {b, t}), torch::ones({b, t}, torch::kBool));
    });
    torch::manual_seed(100 + run);
    auto idx = torch::randint(cfg.vocab_size, {B, T});
    auto labels = torch::randint(cfg.vocab_size, {B, T});
    torch::Tensor keep = random_keep(B, T, 0.5, 17 + run);
    if (c.ragged) {  // rows keep different counts: row 0 more, row 2 fewer
      keep[0].narrow(0, 0, 20).fill_(true);
      keep[2].narrow(0, 30, 40).fill_(false);
    }

    zero_grads(*m);
    auto loss = loss_of(m, idx, labels, keep);
    ASSERT_GT(hook_every_saved_tensor(loss), 0);
    auto stats = filter_backward(loss, keep, plan, {c.attention});
    EXPECT_GT(stats.tensors_hooked, 0);
    loss.backward();
    auto g_collider = grads_of(*m);

    m->set_attention_impl(models::AttentionImpl::kEager);  // the oracle is written for the explicit graph
    set_attention_oracle(*m, AttentionOracle{keep, c.attention == AttentionGrad::kExactQuery});
    zero_grads(*m);
    loss_of(m, idx, labels, keep).backward();
    set_attention_oracle(*m, std::nullopt);
    std::string worst;
    EXPECT_LE(max_rel_diff(g_collider, grads_of(*m), &worst), 1e-4) << "run " << run << ", worst parameter: " << worst;
  }
}

std::vector<Case> all_cases() {
  std::vector<Case> out;
  for (const char* p : {"tinyllama-debug", "qwen2.5-debug", "phi-1.5-debug", "mixtral-debug"})
    for (auto a : {AttentionGrad::kKeptOnly, AttentionGrad::kExactQuery})
      for (bool sdpa : {false, true})
        for (bool ragged : {false, true}) out.push_back({p, a, sdpa, ragged});
  return out;
}

INSTANTIATE_TEST_SUITE_P(AllFamilies, SavedHooksGrad, ::testing::ValuesIn(all_cases()), name_of);

}  // namespace
