// Training step (harness/components/train_step.h): method names, loss_only at filter 0 == regular exactly
// (gradients and parameters), determinism for a seed, loss falls on a small English text
// (byte-level tokens), per-layer markers leave gradients unchanged and fire in order, and the
// collider / masked methods agree with each other (needs the rewriter on the model graphs);
// forward_drop's step is the plain backward of CausalLM::forward(ids, middle_BN) with the full loss.
// Run: OMP_NUM_THREADS=1 build-harness/tests/test_train_step
#include "harness/components/train_step.h"
#include "models/model.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>

namespace ch = collider::harness;
namespace cm = collider::models;

namespace {

const char* kText =
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
    "it was the season of Darkness, it was the spring of hope, it was the winter of despair, we had "
    "everything before us, we had nothing before us, we were all going direct to Heaven, we were all going "
    "direct the other way.";

// Byte-level batch of B windows of T+1 bytes from the text, starting at `offset` (wrapping).
ch::Batch text_batch(int64_t B, int64_t T, int64_t offset) {
  const std::string text(kText);
  auto ids = torch::empty({B, T + 1}, torch::kLong);
  auto acc = ids.accessor<int64_t, 2>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t <= T; ++t) {
      acc[b][t] = static_cast<unsigned char>(text[(offset + b * 37 + t) % text.size()]);
    }
  }
  ch::Batch batch;
  batch.input_ids_BT = ids.narrow(1, 0, T).contiguous();
  batch.labels_BT = ids.narrow(1, 1, T).contiguous();
  return batch;
}

ch::StepConfig config(ch::Method m, double ratio) {
  ch::StepConfig c;
  c.spec.method = m;
  c.filter_ratio = ratio;
  return c;
}

ch::Trainer make_trainer(const std::string& preset, ch::StepConfig c, uint64_t seed = 0) {
  return ch::Trainer(cm::build_model(cm::preset(preset), cm::AttentionImpl::kEager, seed), std::move(c), torch::kCPU,
                     seed);
}

std::vector<torch::Tensor> params(ch::Trainer& t) {
  std::vector<torch::Tensor> out;
  for (auto& p : t.model()->parameters()) out.push_back(p.detach().clone());
  return out;
}

std::vector<torch::Tensor> grads(ch::Trainer& t) {
  std::vector<torch::Tensor> out;
  for (auto& p : t.model()->parameters()) out.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
  return out;
}

void expect_all_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].defined(), b[i].defined()) << what << " #" << i;
    if (a[i].defined()) { EXPECT_TRUE(torch::equal(a[i], b[i])) << what << " #" << i << " differs"; }
  }
}

void expect_all_close(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b, double rtol,
                      double atol, const char* what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].defined(), b[i].defined()) << what << " #" << i;
    if (a[i].defined()) {
      EXPECT_TRUE(torch::allclose(a[i], b[i], rtol, atol))
          << what << " #" << i << " max abs diff " << (a[i] - b[i]).abs().max().item<double>();
    }
  }
}

}  // namespace

TEST(TrainStep, MethodNamesRoundTrip) {
  for (auto m : {ch::Method::kRegular, ch::Method::kLossOnly, ch::Method::kCollider, ch::Method::kMasked,
                 ch::Method::kForwardDrop}) {
    EXPECT_EQ(ch::method_from_string(ch::to_string(m)), m);
  }
  EXPECT_STREQ(ch::to_string(ch::Method::kForwardDrop), "forward_drop");
  EXPECT_FALSE(ch::uses_attention_grad(ch::Method::kForwardDrop));
  EXPECT_EQ(cm::attention_grad_name({ch::Method::kForwardDrop, collider::AttentionGrad::kExactQuery}), "none");
  EXPECT_FALSE(cm::uses_selection(ch::Method::kForwardDrop));
  EXPECT_THROW(ch::method_from_string("sparse"), std::invalid_argument);
  EXPECT_TRUE(ch::uses_attention_grad(ch::Method::kCollider));
  EXPECT_FALSE(ch::uses_attention_grad(ch::Method::kLossOnly));
}

TEST(TrainStep, RejectsBadConfigurations) {
  EXPECT_THROW(make_trainer("tinyllama-debug", config(ch::Method::kLossOnly, 1.0)), std::invalid_argument);
  auto bf = config(ch::Method::kRegular, 0.0);
  bf.bf16_autocast = true;
  EXPECT_THROW(make_trainer("tinyllama-debug", bf), std::invalid_argument);
  auto rs = config(ch::Method::kLossOnly, 0.5);
  rs.spec.score = ch::Score::kExcessLoss;
  auto t = make_trainer("tinyllama-debug", rs);
  EXPECT_THROW(t.step(text_batch(2, 32, 0)), c10::Error);  // no ref_loss_BT in the batch
}

// DESIGN.md section 3: filter_ratio = 0 reproduces regular. For loss_only this must be exact.
TEST(TrainStep, LossOnlyAtZeroEqualsRegularExactly) {
  for (const char* preset : {"tinyllama-debug", "qwen2.5-debug", "phi-1.5-debug"}) {
    SCOPED_TRACE(preset);
    auto reg = make_trainer(preset, config(ch::Method::kRegular, 0.0), 3);
    auto lo = make_trainer(preset, config(ch::Method::kLossOnly, 0.0), 3);
    expect_all_equal(params(reg), params(lo), "initial parameter");
    auto batch = text_batch(2, 40, 5);
    auto r1 = reg.step(batch);
    auto r2 = lo.step(batch);
    EXPECT_EQ(r1.loss, r2.loss);
    EXPECT_EQ(r2.tokens_kept, r2.tokens);
    expect_all_equal(grads(reg), grads(lo), "gradient");
    expect_all_equal(params(reg), params(lo), "parameter after one step");
    reg.step(text_batch(2, 40, 77));
    lo.step(text_batch(2, 40, 77));
    expect_all_equal(params(reg), params(lo), "parameter after two steps");
  }
}

TEST(TrainStep, DeterministicForASeed) {
  auto c = config(ch::Method::kLossOnly, 0.5);
  c.spec.score = ch::Score::kRandom;
  auto a = make_trainer("tinyllama-debug", c, 11);
  auto b = make_trainer("tinyllama-debug", c, 11);
  torch::Generator ga = at::detail::createCPUGenerator(5), gb = at::detail::createCPUGenerator(5);
  for (int s = 0; s < 3; ++s) {
    auto ra = a.step(ch::random_batch(2, 32, 256, ga, torch::kCPU));
    auto rb = b.step(ch::random_batch(2, 32, 256, gb, torch::kCPU));
    EXPECT_EQ(ra.loss, rb.loss);
    EXPECT_EQ(ra.tokens_kept, rb.tokens_kept);
  }
  expect_all_equal(params(a), params(b), "parameter after three steps");
  // A different seed gives a different model (the test above can fail).
  auto other = make_trainer("tinyllama-debug", c, 12);
  EXPECT_FALSE(torch::equal(params(a)[0], params(other)[0]));
}

TEST(TrainStep, LossFallsOnEnglishText) {
  for (auto m : {ch::Method::kRegular, ch::Method::kLossOnly}) {
    SCOPED_TRACE(ch::to_string(m));
    auto c = config(m, m == ch::Method::kRegular ? 0.0 : 0.4);
    c.lr = 3e-3;
    c.weight_decay = 0.0;
    auto t = make_trainer("tinyllama-debug", c, 1);
    double first = 0, last = 0;
    for (int s = 0; s < 30; ++s) {
      auto r = t.step(text_batch(4, 48, s * 13));
      if (s == 0) first = r.loss;
      last = r.loss;
    }
    // Byte-level random init starts near ln(256) = 5.55; 30 steps on one paragraph must learn
    // its character statistics.
    EXPECT_GT(first, 5.0);
    EXPECT_LT(last, 0.75 * first) << "first " << first << " last " << last;
  }
}

TEST(TrainStep, SelectionKeepsTheRequestedShare) {
  auto t = make_trainer("tinyllama-debug", config(ch::Method::kLossOnly, 0.5));
  auto r = t.step(text_batch(3, 64, 0));
  EXPECT_EQ(r.tokens, 3 * 64);
  EXPECT_EQ(r.kept_per_seq, 32);
  EXPECT_EQ(r.tokens_kept, 3 * 32);
  // Reference scores: the kept tokens are those with the highest excess loss.
  auto c = config(ch::Method::kLossOnly, 0.5);
  c.spec.score = ch::Score::kExcessLoss;
  auto tr = make_trainer("tinyllama-debug", c);
  auto batch = text_batch(1, 16, 0);
  auto loss_BT = torch::zeros({1, 16});
  batch.ref_loss_BT = -torch::arange(16, torch::kFloat).unsqueeze(0);  // excess grows with t
  auto keep = tr.select(loss_BT, batch);
  EXPECT_EQ(keep.sum().item<int64_t>(), 8);
  EXPECT_TRUE(keep.narrow(1, 8, 8).all().item<bool>());
}

TEST(TrainStep, PhasesPartitionTheStep) {
  auto t = make_trainer("tinyllama-debug", config(ch::Method::kLossOnly, 0.5));
  auto r = t.step(text_batch(2, 32, 0));
  for (double v : {r.fwd_ms, r.filter_ms, r.bwd_ms, r.optim_ms, r.select_ms}) EXPECT_GE(v, 0.0);
  EXPECT_NEAR(r.fwd_ms + r.filter_ms + r.bwd_ms + r.allreduce_ms + r.optim_ms, r.step_ms, 1e-6);
  EXPECT_EQ(r.allreduce_ms, 0.0);  // no GradientReducer: no all-reduce phase
  EXPECT_LE(r.select_ms, r.filter_ms + 1e-9);
  EXPECT_GT(r.grad_norm, 0.0);
}

TEST(TrainStep, LayerMarkersFireInOrderAndLeaveGradientsUnchanged) {
  auto plain = make_trainer("qwen2.5-debug", config(ch::Method::kLossOnly, 0.5), 2);
  auto c = config(ch::Method::kLossOnly, 0.5);
  c.layer_timing = true;
  auto timed = make_trainer("qwen2.5-debug", c, 2);
  auto batch = text_batch(2, 32, 9);
  plain.step(batch);
  auto r = timed.step(batch);
  expect_all_equal(grads(plain), grads(timed), "gradient with markers");
  std::vector<std::string> names;
  for (const auto& l : r.layers) names.push_back(l.name);
  EXPECT_EQ(names, (std::vector<std::string>{"embedding", "layer.00", "layer.01", "final_norm", "lm_head"}));
  auto fwd = timed.layer_timer()->forward_order();
  auto bwd = timed.layer_timer()->backward_order();
  std::reverse(bwd.begin(), bwd.end());
  EXPECT_EQ(fwd, bwd);
  double sum_bwd = 0;
  for (const auto& l : r.layers) {
    EXPECT_GE(l.fwd_ms, 0.0) << l.name;
    EXPECT_GE(l.bwd_ms, 0.0) << l.name;
    sum_bwd += l.bwd_ms;
  }
  // The segments partition [backward start, backward end] inside bwd_ms.
  EXPECT_LE(sum_bwd, r.bwd_ms + 1e-6);
  EXPECT_FALSE(ch::LayerTimer::marker_node_name().empty());
}

// --- methods that rewrite the backward (need collider::filter_backward on these models) ------

TEST(TrainStep, ColliderAtZeroMatchesLossOnly) {
  for (auto ag : {collider::AttentionGrad::kKeptOnly, collider::AttentionGrad::kExactQuery}) {
    SCOPED_TRACE(collider::to_string(ag));
    auto lo = make_trainer("tinyllama-debug", config(ch::Method::kLossOnly, 0.0), 4);
    auto cc = config(ch::Method::kCollider, 0.0);
    cc.spec.attention_grad = ag;
    auto co = make_trainer("tinyllama-debug", cc, 4);
    auto batch = text_batch(2, 32, 3);
    lo.step(batch);
    auto r = co.step(batch);
    EXPECT_EQ(r.tokens_kept, r.tokens);
    expect_all_close(grads(lo), grads(co), 1e-5, 1e-6, "gradient");
  }
}

TEST(TrainStep, ColliderMatchesMaskedOracle) {
  for (const char* preset : {"tinyllama-debug", "qwen2.5-debug", "phi-1.5-debug"}) {
    for (auto ag : {collider::AttentionGrad::kKeptOnly, collider::AttentionGrad::kExactQuery}) {
      SCOPED_TRACE(std::string(preset) + " " + collider::to_string(ag));
      auto cc = config(ch::Method::kCollider, 0.5);
      cc.spec.attention_grad = ag;
      cc.layer_timing = true;  // markers must survive the rewrite
      auto mc = config(ch::Method::kMasked, 0.5);
      mc.spec.attention_grad = ag;
      auto co = make_trainer(preset, cc, 6);
      auto ma = make_trainer(preset, mc, 6);
      auto batch = text_batch(2, 48, 21);
      auto rc = co.step(batch);
      auto rm = ma.step(batch);
      EXPECT_EQ(rc.tokens_kept, rm.tokens_kept);
      EXPECT_NEAR(rc.loss, rm.loss, 1e-6);
      EXPECT_GT(rc.filter.nodes_rewritten, 0);
      EXPECT_EQ(rc.layers.size(), 5u);
      expect_all_close(grads(co), grads(ma), 1e-4, 1e-6, "gradient");
    }
  }
}

// The fused LM head (StepConfig::fused_head, manifest run.head = "fused") gives every method the
// gradient the model's own head gives: Llama (untied), Qwen2 (tied to the embedding), Phi (a head
// bias), Mixtral; regular, loss_only, collider in both semantics and masked, equal and ragged
// (batch_topk) rows; random scores, so both heads keep the same tokens.
TEST(TrainStep, FusedHeadGivesTheModelsOwnHeadsGradient) {
  for (const char* preset : {"tinyllama-debug", "qwen2.5-debug", "phi-1.5-debug", "mixtral-debug"}) {
    for (auto m : {ch::Method::kRegular, ch::Method::kLossOnly, ch::Method::kCollider, ch::Method::kMasked}) {
      for (auto ag : {collider::AttentionGrad::kKeptOnly, collider::AttentionGrad::kExactQuery}) {
        for (auto policy : {collider::SelectPolicy::kPerSequence, collider::SelectPolicy::kBatchTopK}) {
          if (!ch::uses_attention_grad(m) && ag == collider::AttentionGrad::kExactQuery) continue;
          if (m == ch::Method::kRegular && policy == collider::SelectPolicy::kBatchTopK) continue;
          SCOPED_TRACE(std::string(preset) + " " + ch::to_string(m) + " " + collider::to_string(ag) + " " +
                       (policy == collider::SelectPolicy::kBatchTopK ? "batch_topk" : "per_sequence"));
          auto c = config(m, 0.5);
          c.spec.attention_grad = ag;
          c.spec.score = ch::Score::kRandom;
          c.spec.policy = policy;
          auto dense = make_trainer(preset, c, 8);
          c.fused_head = true;
          auto fused = make_trainer(preset, c, 8);
          auto batch = text_batch(2, 40, 5);
          auto rd = dense.step(batch);
          auto rf = fused.step(batch);
          EXPECT_EQ(rd.tokens_kept, rf.tokens_kept);
          EXPECT_NEAR(rd.loss, rf.loss, 1e-5);
          EXPECT_NEAR(rd.loss_all, rf.loss_all, 1e-5);
          expect_all_close(grads(fused), grads(dense), 1e-4, 1e-6, "gradient");
        }
      }
    }
  }
}

// --- forward_drop: forward token dropping in the middle layers, full loss, plain backward -----

namespace {

// The -debug preset with 4 decoder layers (forward_drop needs 3 or more; the -debug ones have 2).
ch::Trainer four_layer_trainer(const std::string& preset, ch::StepConfig c, uint64_t seed) {
  cm::ModelConfig cfg = cm::preset(preset);
  cfg.num_layers = 4;
  return ch::Trainer(cm::build_model(cfg, cm::AttentionImpl::kEager, seed), std::move(c), torch::kCPU, seed);
}

}  // namespace

TEST(TrainStep, ForwardDropIsThePlainBackwardOfTheDroppedForward) {
  for (const char* preset : {"tinyllama-debug", "qwen2.5-debug", "phi-1.5-debug"}) {
    SCOPED_TRACE(preset);
    auto c = config(ch::Method::kForwardDrop, 0.5);
    c.grad_clip = 0;  // .grad() after the step is then the raw gradient
    auto fd = four_layer_trainer(preset, c, 9);
    auto ref = four_layer_trainer(preset, c, 9);  // same weights, same subset generator
    auto batch = text_batch(3, 40, 11);
    batch.labels_BT[1][7] = -100;  // an unlabelled position stays out of the mean
    const auto r = fd.step(batch);

    // The reference: the subset the Trainer drew (its first draw), the model's own
    // forward(ids, middle_BN), the mean over every labelled token, backward.
    const int64_t N = collider::kept_count(40, 0.5, 8);
    auto middle_BN = ref.draw_middle_tokens(3, 40);
    ASSERT_EQ(middle_BN.size(1), N);
    auto logits_BTV = ref.model()->forward(batch.input_ids_BT, middle_BN);
    auto loss = cm::masked_mean_loss(cm::token_losses(logits_BTV, batch.labels_BT), batch.labels_BT != -100);
    loss.backward();

    EXPECT_TRUE(std::isfinite(r.loss));
    EXPECT_EQ(r.loss, loss.item<double>());
    EXPECT_EQ(r.loss, r.loss_all) << "forward_drop keeps every token's loss";
    EXPECT_EQ(r.tokens, 3 * 40);
    EXPECT_EQ(r.tokens_kept, 3 * 40 - 1) << "every labelled token's loss is backpropagated";
    EXPECT_EQ(r.middle_tokens_per_seq, N);
    EXPECT_EQ(r.filter.nodes_rewritten, 0) << "no graph rewrite";
    expect_all_equal(grads(fd), grads(ref), "gradient");

    // The subset matters: the regular step of the same model gives another gradient.
    auto rc = config(ch::Method::kRegular, 0.0);
    rc.grad_clip = 0;
    auto reg = four_layer_trainer(preset, rc, 9);
    EXPECT_EQ(reg.step(batch).middle_tokens_per_seq, 0);
    EXPECT_FALSE(torch::equal(grads(reg)[1], grads(fd)[1]));
  }
}

TEST(TrainStep, ForwardDropDrawsAFreshSubsetEveryStepDeterministicInTheSeedAndStep) {
  auto c = config(ch::Method::kForwardDrop, 0.4);
  auto a = four_layer_trainer("tinyllama-debug", c, 5);
  auto b = four_layer_trainer("tinyllama-debug", c, 5);
  auto first = a.draw_middle_tokens(2, 64), second = a.draw_middle_tokens(2, 64);
  EXPECT_FALSE(torch::equal(first, second));
  EXPECT_TRUE(torch::equal(first, b.draw_middle_tokens(2, 64)));
  // A run resumed after one step (training_loop.cpp: set_draws) draws what the second step drew.
  auto resumed = four_layer_trainer("tinyllama-debug", c, 5);
  resumed.set_draws(1);
  EXPECT_TRUE(torch::equal(second, resumed.draw_middle_tokens(2, 64)));
  EXPECT_EQ(first.size(1), collider::kept_count(64, 0.4, 8));
  // Filter 0: the middle layers see every token, so the step is the regular one bit for bit.
  auto fd0 = four_layer_trainer("tinyllama-debug", config(ch::Method::kForwardDrop, 0.0), 5);
  auto reg = four_layer_trainer("tinyllama-debug", config(ch::Method::kRegular, 0.0), 5);
  auto batch = text_batch(2, 32, 3);
  EXPECT_EQ(fd0.step(batch).loss, reg.step(batch).loss);
  expect_all_equal(grads(fd0), grads(reg), "gradient at filter 0");
}

TEST(TrainStep, ForwardDropRefusesTooFewLayersOrNoMiddleToken) {
  // The -debug presets have 2 decoder layers: nothing would be left in the middle.
  EXPECT_THROW(make_trainer("tinyllama-debug", config(ch::Method::kForwardDrop, 0.4)), std::invalid_argument);
  auto t = four_layer_trainer("tinyllama-debug", config(ch::Method::kForwardDrop, 0.1), 1);
  EXPECT_THROW(t.step(text_batch(1, 8, 0)), std::invalid_argument);  // drop 0.8 -> 8 of 8: none left
}

// An interleaved timing group switches methods on one trainer (Trainer::set_method): the switch
// refuses what the constructor refuses and leaves the trainer's method as it was.
TEST(TrainStep, SetMethodRefusesWhatTheConstructorRefuses) {
  auto t = make_trainer("tinyllama-debug", config(ch::Method::kRegular, 0.0));
  ch::MethodSpec drop;
  drop.method = ch::Method::kForwardDrop;
  EXPECT_THROW(t.set_method(drop, 0.4), std::invalid_argument);  // 2 decoder layers
  EXPECT_THROW(t.set_method(ch::MethodSpec{}, 1.0), std::invalid_argument);
  EXPECT_EQ(t.config().spec.method, ch::Method::kRegular);
  ch::MethodSpec lo;
  lo.method = ch::Method::kLossOnly;
  t.set_method(lo, 0.5);
  EXPECT_EQ(t.config().spec.method, ch::Method::kLossOnly);
  EXPECT_EQ(t.config().filter_ratio, 0.5);
}
