// Plan life cycle and the rewriter's refusals: reuse over many steps with a new mask each step,
// text round trip, rejection of another model's graph, a mixture-of-experts step in which an expert
// receives no token, and a clear error for every input the rewriter cannot handle (DESIGN.md section 4: it never returns a graph with wrong gradients).
// Run: build/tests/test_core_plan
#include "collider_test_util.h"
#include "gpt2_test_model.h"

#include <gtest/gtest.h>

using namespace collider;
using namespace collider::testing;

namespace {

constexpr int64_t kVocab = 61, kDim = 16, kHeads = 2, kMaxT = 96;

Gpt2 make_model(int64_t layers, uint64_t seed = 0) {
  torch::manual_seed(seed);
  return Gpt2(kVocab, kDim, kHeads, layers, kMaxT);
}

Plan plan_for(Gpt2& m) {
  return trace_plan([&](int64_t B, int64_t T) {
    return masked_ce(m->forward(torch::randint(kVocab, {B, T})), torch::randint(kVocab, {B, T}),
                     torch::ones({B, T}, torch::kBool));
  });
}

TEST(Plan, ReusedOverTwentyStepsWithNewMasks) {
  Gpt2 m = make_model(2);
  Plan plan = plan_for(m);
  for (int step = 0; step < 20; ++step) {
    const int64_t B = 2, T = 48;
    auto idx = torch::randint(kVocab, {B, T});
    auto labels = torch::randint(kVocab, {B, T});
    auto keep = random_keep(B, T, 0.4, 100 + step);
    const auto attention = step % 2 ? AttentionGrad::kExactQuery : AttentionGrad::kKeptOnly;
    zero_grads(*m);
    auto loss = masked_ce(m->forward(idx), labels, keep);
    filter_backward(loss, keep, plan, {attention});
    loss.backward();
    auto g = grads_of(*m);
    zero_grads(*m);
    m->oracle = AttentionOracle{keep, attention == AttentionGrad::kExactQuery};
    masked_ce(m->forward(idx), labels, keep).backward();
    m->oracle.reset();
    ASSERT_LE(max_rel_diff(g, grads_of(*m)), 1e-4) << "step " << step;
  }
}

TEST(Plan, TextRoundTrip) {
  Gpt2 m = make_model(1);
  Plan plan = plan_for(m);
  const std::string text = plan.to_string();
  Plan back = Plan::from_string(text);
  EXPECT_EQ(back.to_string(), text);
  EXPECT_EQ(back.num_nodes(), plan.num_nodes());
  // The restored plan drives a real rewrite.
  auto keep = random_keep(2, 32, 0.5, 3);
  auto loss = masked_ce(m->forward(torch::randint(kVocab, {2, 32})), torch::randint(kVocab, {2, 32}), keep);
  EXPECT_GT(filter_backward(loss, keep, back).tensors_gathered, 0);
  loss.backward();
  EXPECT_NE(error_of([&] { Plan::from_string("not a plan"); }).find("not a collider plan"), std::string::npos);
}

// A `detach` line (an attention core's row maximum, plan_impl.h DetachedEdge) must name a
// subtraction of the plan; a route (grouped experts) an IndexBackward0 or IndexAddBackward0 node.
TEST(Plan, DetachAndRouteLinesAreChecked) {
  Gpt2 m = make_model(1);
  const std::string text = plan_for(m).to_string();
  auto msg = error_of([&] { Plan::from_string(text + "detach 0 1\n"); });
  EXPECT_NE(msg.find("not a SubBackward0 node"), std::string::npos) << msg;
  msg = error_of([&] { Plan::from_string(text + "detach -1 0\n"); });
  EXPECT_NE(msg.find("malformed detach"), std::string::npos) << msg;
  // A grouped route's token slots (kind 8) pointing at node 0, which sends no route back.
  msg = error_of([&] { Plan::from_string(text + "field indices_ 0 0 1 0 -1 1 0:8:0:2:0\n"); });
  EXPECT_NE(msg.find("is not an IndexAddBackward0 or IndexBackward0 node"), std::string::npos) << msg;
  msg = error_of([&] { Plan::from_string(text + "field indices_ 0 0 1 0 -1 1 0:11:0:2\n"); });  // no kind 11
  EXPECT_NE(msg.find("malformed dimension"), std::string::npos) << msg;
}

TEST(Plan, AnotherModelsGraphIsRejected) {
  Gpt2 small = make_model(1), big = make_model(2);
  Plan plan = plan_for(small);
  auto keep = random_keep(2, 32, 0.5, 3);
  auto loss = masked_ce(big->forward(torch::randint(kVocab, {2, 32})), torch::randint(kVocab, {2, 32}), keep);
  auto msg = error_of([&] { filter_backward(loss, keep, plan); });
  EXPECT_NE(msg.find("does not match the plan"), std::string::npos) << msg;
  EXPECT_NE(msg.find("Re-trace"), std::string::npos) << msg;
}

TEST(Plan, BadInputsGiveClearErrors) {
  Gpt2 m = make_model(1);
  Plan plan = plan_for(m);
  auto labels = torch::randint(kVocab, {2, 32});
  auto fresh_loss = [&](const torch::Tensor& keep) {
    return masked_ce(m->forward(torch::randint(kVocab, {2, 32})), labels, keep);
  };
  auto keep = random_keep(2, 32, 0.5, 3);
  // A mask that keeps nothing (unequal kept counts per row are accepted: test_collider_ragged).
  auto none = torch::zeros_like(keep);
  EXPECT_NE(error_of([&] { filter_backward(fresh_loss(keep), none, plan); }).find("keeps no token"), std::string::npos);
  // A mask whose T does not fit the graph: the mask is named, not the plan.
  auto wrong_T = random_keep(2, 40, 0.5, 3);
  EXPECT_NE(error_of([&] {
              filter_backward(fresh_loss(keep), wrong_T, plan);
            }).find("the keep mask is [2, 40] but the loss was computed on [2, 32] positions"),
            std::string::npos);
  // Not a bool mask.
  EXPECT_NE(error_of([&] { filter_backward(fresh_loss(keep), keep.to(torch::kFloat), plan); }).find("bool [B, T]"),
            std::string::npos);
  // A loss without grad_fn.
  EXPECT_NE(error_of([&] { filter_backward(torch::zeros({}), keep, plan); }).find("no grad_fn"), std::string::npos);
  // An empty plan.
  EXPECT_NE(error_of([&] { filter_backward(fresh_loss(keep), keep, Plan()); }).find("empty plan"), std::string::npos);
  // Twice on the same loss: said as it is (the cut sizes would no longer match the plan either).
  auto loss = fresh_loss(keep);
  filter_backward(loss, keep, plan);
  EXPECT_NE(error_of([&] { filter_backward(loss, keep, plan); }).find("already rewritten"), std::string::npos);
}

// A custom autograd function the rewriter knows nothing about.
struct Opaque : public torch::autograd::Function<Opaque> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, torch::Tensor x) { return x * 2; }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list g) {
    return {g[0] * 2};
  }
};

TEST(Plan, UnknownNodesAreRefusedAndTokenMixingOpsRunWhole) {
  auto w = torch::randn({8, 8}, torch::requires_grad());
  auto opaque = error_of([&] {
    trace_plan([&](int64_t B, int64_t T) { return Opaque::apply(torch::randn({B, T, 8}).matmul(w)).sum(); });
  });
  EXPECT_NE(opaque.find("register_passthrough_node"), std::string::npos) << opaque;
  // Declared safe (by the node's own name), the same graph traces.
  register_passthrough_node(Opaque::apply(torch::randn({1}, torch::requires_grad())).grad_fn()->name());
  auto ok = error_of([&] {
    trace_plan([&](int64_t B, int64_t T) { return Opaque::apply(torch::randn({B, T, 8}).matmul(w)).sum(); });
  });
  EXPECT_EQ(ok, "(no error)");
  // cumsum over the token dimension mixes positions: it runs whole (DESIGN.md section 3), its dropped rows
  // detached at its input. Oracle: plain autograd with torch.where(keep, x, x.detach()) there.
  auto wd = torch::randn({8, 8}, torch::dtype(torch::kDouble).requires_grad(true));
  auto x = torch::randn({3, 16, 8}, torch::kDouble);
  auto keep = random_keep(3, 16, 0.5, 2);
  auto loss_of = [&](const torch::Tensor& x_BTD, const torch::Tensor& keep_BT, bool oracle) {
    auto h = x_BTD.matmul(wd);  // [B, T, 8]
    if (oracle) h = torch::where(keep_BT.unsqueeze(-1), h, h.detach());
    return (torch::tanh(h.cumsum(1)).sum(-1) * keep_BT.to(torch::kDouble)).sum();
  };
  Plan plan = trace_plan([&](int64_t B, int64_t T) {
    return loss_of(torch::randn({B, T, 8}, torch::kDouble), torch::ones({B, T}, torch::kBool), false);
  });
  EXPECT_NE(plan.to_string().find("CumsumBackward0 4"), std::string::npos) << plan.to_string();
  loss_of(x, keep, true).backward();
  const auto oracle = wd.grad().clone();
  for (auto a : {AttentionGrad::kKeptOnly, AttentionGrad::kExactQuery}) {
    wd.mutable_grad() = torch::Tensor();
    auto loss = loss_of(x, keep, false);
    FilterStats stats = filter_backward(loss, keep, plan, {a});
    loss.backward();
    EXPECT_EQ(stats.nodes_run_whole, 1);
    EXPECT_TRUE(torch::allclose(wd.grad(), oracle, 1e-10, 1e-12)) << (wd.grad() - oracle).abs().max().item<double>();
  }
}

// A fused attention with an additive bias (ALiBi-like, per head, [H, T, T]) and with a mask
// broadcast from [T, T]: the filtered gradient equals the masked method's (the oracle, computed on
// full-size tensors with dropped rows and columns zeroed). The loss counts only kept positions.
TEST(Plan, FusedAttentionWithBiasOrMaskIsFiltered) {
  torch::manual_seed(3);
  auto w = torch::randn({8, 8}, torch::dtype(torch::kDouble).requires_grad(true));
  auto alibi = [](int64_t T) {  // [2, T, T]: -slope * distance, causal
    auto i = torch::arange(T, torch::kDouble);
    auto dist = (i.view({T, 1}) - i.view({1, T}));
    auto bias = torch::stack({-0.5 * dist, -0.25 * dist});
    return bias.masked_fill(dist.lt(0).expand({2, T, T}), -INFINITY);
  };
  auto window = [](int64_t T) {  // [T, T] bool: causal, 6 positions back
    auto i = torch::arange(T);
    return (i.view({1, T}) <= i.view({T, 1})) & (i.view({T, 1}) - i.view({1, T}) < 6);
  };
  for (int kind = 0; kind < 2; ++kind) {
    torch::Tensor x_fixed = torch::randn({2, 16, 8}, torch::kDouble);
    torch::Tensor keep = random_keep(2, 16, 0.5, 1);
    auto loss_of = [&](const torch::Tensor& x_BTD, const torch::Tensor& keep_BT) {
      const int64_t B = x_BTD.size(0), T = x_BTD.size(1);
      auto h = x_BTD.matmul(w).view({B, T, 2, 4}).transpose(1, 2);
      auto mask = kind == 0 ? alibi(T) : window(T);
      auto o = torch::scaled_dot_product_attention(h, h, h, mask, 0.0, false);  // [B, 2, T, 4]
      return (o.sum({1, 3}) * keep_BT.to(torch::kDouble)).sum();
    };
    Plan plan = trace_plan([&](int64_t B, int64_t T) {
      return loss_of(torch::randn({B, T, 8}, torch::kDouble), torch::ones({B, T}, torch::kBool));
    });
    for (auto a : {AttentionGrad::kKeptOnly, AttentionGrad::kExactQuery}) {
      w.mutable_grad() = torch::Tensor();
      auto loss = loss_of(x_fixed, keep);
      filter_backward(loss, keep, plan, {a});
      loss.backward();
      auto filtered = w.grad().clone();
      w.mutable_grad() = torch::Tensor();
      loss = loss_of(x_fixed, keep);
      mask_backward(loss, keep, plan, {a});
      loss.backward();
      EXPECT_TRUE(torch::allclose(filtered, w.grad(), 1e-6, 1e-9))
          << (kind == 0 ? "bias " : "window ") << to_string(a) << ": "
          << (filtered - w.grad()).abs().max().item<double>();
    }
  }
}

// A tensor assembled in place from two parts along its last dimension (x[..., :n].copy_(a),
// x[..., n:].copy_(b), as DeepSeek's latent attention builds its keys): its CopySlices nodes are
// cut, and the filtered gradient equals the masked method's. Another op written in place into a
// slice (mul_) is refused with the graph untouched.
TEST(Plan, SliceWrittenInPlaceIsCut) {
  torch::manual_seed(4);
  auto wa = torch::randn({8, 4}, torch::dtype(torch::kDouble).requires_grad(true));
  auto wb = torch::randn({8, 4}, torch::dtype(torch::kDouble).requires_grad(true));
  auto loss_of = [&](const torch::Tensor& x_BTD, const torch::Tensor& keep_BT, bool mul) {
    auto k = torch::empty({x_BTD.size(0), x_BTD.size(1), 8}, torch::kDouble);
    k.narrow(2, 0, 4).copy_(x_BTD.matmul(wa));
    k.narrow(2, 4, 4).copy_(x_BTD.matmul(wb).tanh());
    if (mul) k.narrow(2, 4, 4).mul_(2);
    return ((k * k).sum(2) * keep_BT.to(torch::kDouble)).sum();
  };
  auto trace = [&](bool mul) {
    return trace_plan([&](int64_t B, int64_t T) {
      return loss_of(torch::randn({B, T, 8}, torch::kDouble), torch::ones({B, T}, torch::kBool), mul);
    });
  };
  Plan plan = trace(false);
  auto x = torch::randn({3, 17, 8}, torch::kDouble);
  auto keep = random_keep(3, 17, 0.5, 2);
  for (auto method : {0, 1}) {
    std::vector<torch::Tensor> got;
    for (auto fn : {&filter_backward, &mask_backward}) {
      wa.mutable_grad() = torch::Tensor();
      wb.mutable_grad() = torch::Tensor();
      auto loss = loss_of(x, keep, false);
      auto stats = (*fn)(loss, keep, plan, {method ? AttentionGrad::kExactQuery : AttentionGrad::kKeptOnly});
      if (fn == &filter_backward) {
        EXPECT_GT(stats.nodes_rewritten, 2);
      }
      loss.backward();
      got.push_back(torch::cat({wa.grad().flatten(), wb.grad().flatten()}));
    }
    EXPECT_TRUE(torch::allclose(got[0], got[1], 1e-9, 1e-12)) << (got[0] - got[1]).abs().max().item<double>();
  }
  auto refused = error_of([&] { trace(true); });
  EXPECT_NE(refused.find("not copy_"), std::string::npos) << refused;
  EXPECT_LE(refused.size(), 300u) << refused;
}

// A mixture-of-experts layer written the way transformers' eager experts write it: each expert's
// tokens gathered, its SwiGLU-free MLP, the routing weight, index_add_ back; an expert that receives
// no token is skipped, so its route is absent from that step's graph. `avoid_X` is added to the
// router's logits (a very negative entry leaves that expert without tokens).
struct SkippingMoe {
  static constexpr int64_t kExperts = 4, kTopK = 2, kWidth = 8, kFfn = 12;
  torch::Tensor emb_VD, gate_DX, up_XDF, down_XFD;

  SkippingMoe() {
    torch::manual_seed(11);
    auto param = [](std::vector<int64_t> sizes) {
      return (torch::randn(sizes, torch::kDouble) * 0.5).requires_grad_(true);
    };
    emb_VD = param({kVocab, kWidth});
    gate_DX = param({kWidth, kExperts});
    up_XDF = param({kExperts, kWidth, kFfn});
    down_XFD = param({kExperts, kFfn, kWidth});
  }

  torch::Tensor loss(const torch::Tensor& idx_BT, const torch::Tensor& keep_BT, const torch::Tensor& avoid_X) const {
    const int64_t B = idx_BT.size(0), T = idx_BT.size(1);
    auto x_MD = torch::embedding(emb_VD, idx_BT).reshape({B * T, kWidth});
    auto probs_MX = torch::softmax(x_MD.matmul(gate_DX) + avoid_X, -1);
    auto [top_MK, expert_MK] = torch::topk(probs_MX, kTopK, -1);
    top_MK = top_MK / top_MK.sum(-1, /*keepdim=*/true);
    auto out_MD = torch::zeros_like(x_MD);
    for (int64_t e = 0; e < kExperts; ++e) {
      torch::Tensor tok_R, slot_R;
      {
        torch::NoGradGuard no_grad;
        auto where_R2 = (expert_MK == e).nonzero();
        if (where_R2.size(0) == 0) continue;  // as transformers does
        tok_R = where_R2.select(1, 0).contiguous();
        slot_R = where_R2.select(1, 1).contiguous();
      }
      auto h_RF = torch::tanh(x_MD.index({tok_R}).matmul(up_XDF[e]));
      auto o_RD = h_RF.matmul(down_XFD[e]) * top_MK.index({tok_R, slot_R}).unsqueeze(-1);
      out_MD.index_add_(0, tok_R, o_RD);
    }
    auto per_token_BT = (out_MD * out_MD).sum(-1).reshape({B, T});
    return (per_token_BT * keep_BT.to(torch::kDouble)).sum() / keep_BT.sum();
  }

  torch::Tensor grads() const {
    return torch::cat(
        {emb_VD.grad().flatten(), gate_DX.grad().flatten(), up_XDF.grad().flatten(), down_XFD.grad().flatten()});
  }
  void zero() const {
    for (auto p : {emb_VD, gate_DX, up_XDF, down_XFD}) p.mutable_grad() = torch::Tensor();
  }
};

TEST(Plan, ExpertWithoutTokensIsFiltered) {
  SkippingMoe moe;
  const auto none = torch::zeros({SkippingMoe::kExperts}, torch::kDouble);
  Plan traced = trace_plan([&](int64_t B, int64_t T) {
    return moe.loss(torch::randint(kVocab, {B, T}), torch::ones({B, T}, torch::kBool), none);
  });
  const int64_t B = 3, T = 17;
  auto idx = torch::randint(kVocab, {B, T});
  auto keep = random_keep(B, T, 0.5, 5);
  auto avoid = none.clone();
  avoid[2] = -1e4;  // expert 2 receives no token: its route is absent from the graph
  // Token-wise layer: the gradient of the loss over kept tokens is the plain backward's.
  moe.zero();
  moe.loss(idx, keep, avoid).backward();
  const auto want = moe.grads();
  for (const Plan& plan : {traced, Plan::from_string(traced.to_string())}) {
    for (auto attention : {AttentionGrad::kKeptOnly, AttentionGrad::kExactQuery}) {
      moe.zero();
      auto loss = moe.loss(idx, keep, avoid);
      auto stats = filter_backward(loss, keep, plan, {attention});
      EXPECT_GT(stats.tensors_gathered, 0);
      loss.backward();
      EXPECT_TRUE(torch::allclose(moe.grads(), want, 1e-10, 1e-12)) << (moe.grads() - want).abs().max().item<double>();
    }
  }
  // A plan text without its edges cannot match the smaller graph: refused as another graph, untouched.
  std::string text = traced.to_string(), bare;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("node ", 0) == 0) line = line.substr(0, line.rfind(' '));
    bare += line + "\n";
  }
  auto loss = moe.loss(idx, keep, avoid);
  auto msg = error_of([&] { filter_backward(loss, keep, Plan::from_string(bare)); });
  EXPECT_NE(msg.find("the plan expects"), std::string::npos) << msg;
  moe.zero();
  loss.backward();
  EXPECT_TRUE(torch::equal(moe.grads(), want));
}

}  // namespace
