// Per-layer timing on a mini model (label `slow`): the per-layer backward times (marker
// autograd functions at every layer boundary) account for the backward: their sum is within 15%
// of bwd_ms, for regular and for the Collider-rewritten graph, in the Trainer and in a sweep
// row's layers_bwd_coverage. Every decoder layer, the embedding, final norm and LM head appear.
// Run: OMP_NUM_THREADS=1 build-harness/tests/test_layer_timing_slow
#include "harness/config/manifest.h"
#include "harness/run/results.h"
#include "harness/measure/group.h"
#include "harness/components/train_step.h"
#include "models/model.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>

namespace ch = collider::harness;
namespace cm = collider::models;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

TEST(LayerTimingSlow, PerLayerBackwardSumsToTheBackward) {
  for (auto method : {ch::Method::kRegular, ch::Method::kCollider}) {
    SCOPED_TRACE(ch::to_string(method));
    ch::StepConfig c;
    c.spec.method = method;
    c.filter_ratio = method == ch::Method::kRegular ? 0.0 : 0.4;
    c.layer_timing = true;
    const auto& cfg = cm::preset("tinyllama-mini");
    ch::Trainer t(cm::build_model(cfg), c, torch::kCPU, 0);
    torch::Generator g = at::detail::createCPUGenerator(3);
    std::vector<double> bwd_cov, fwd_cov;
    for (int s = 0; s < 5; ++s) {
      auto r = t.step(ch::random_batch(1, 256, cfg.vocab_size, g, torch::kCPU));
      ASSERT_EQ(r.layers.size(), static_cast<size_t>(cfg.num_layers + 3));
      EXPECT_EQ(r.layers.front().name, "embedding");
      EXPECT_EQ(r.layers[1].name, "layer.00");
      char last[16];
      std::snprintf(last, sizeof last, "layer.%02d", static_cast<int>(cfg.num_layers - 1));
      EXPECT_EQ(r.layers[cfg.num_layers].name, last);
      EXPECT_EQ(r.layers.back().name, "lm_head");
      double fwd = 0, bwd = 0;
      for (const auto& l : r.layers) {
        fwd += l.fwd_ms;
        bwd += l.bwd_ms;
      }
      if (s == 0) continue;  // first step: allocator warm-up
      bwd_cov.push_back(bwd / r.bwd_ms);
      fwd_cov.push_back(fwd / r.fwd_ms);
    }
    EXPECT_GE(median(bwd_cov), 0.85);
    EXPECT_LE(median(bwd_cov), 1.0 + 1e-9);
    EXPECT_GE(median(fwd_cov), 0.85);
  }
}

TEST(LayerTimingSlow, SweepRowReportsTheCoverage) {
  auto m = ch::load_manifest_text(R"(
name = "coverage"
[run]
device = "cpu"
warmup_steps = 1
measure_steps = 3
[axes]
model = "qwen2.5-mini"
seq_len = 256
filter_ratio = 0.5
method = ["loss_only", "collider"]
attention_grad = "exact_query"
)",
                                  "coverage.toml");
  const auto prov = ch::collect_provenance(torch::kCPU);
  for (const auto& p : m.points) {
    auto row = ch::measure_point(m, p, prov, nullptr);
    ASSERT_EQ(row["status"], "ok") << row["error"];
    EXPECT_TRUE(ch::validate_row(row).empty());
    EXPECT_EQ(row["layers"].size(), 4u + 3u);
    const double cov = row["layers_bwd_coverage"];
    EXPECT_GE(cov, 0.85) << p.id();
    EXPECT_LE(cov, 1.0 + 1e-9) << p.id();
  }
}
