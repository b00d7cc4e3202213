// Shared by tests/test_distributed.cpp and its helper process tests/distributed_worker.cpp: the
// training run both sides make (tinyllama-debug, fixed seeds, per-step global batches split
// between the ranks by rows), so that a 2-rank run and a single process on the concatenated
// batch see the same data. Legend: B batch rows, T sequence.
#pragma once

#include "harness/components/distributed.h"
#include "harness/components/train_step.h"
#include "models/model.h"

#include <nlohmann/json.hpp>

#include <memory>
#include <string>
#include <vector>

namespace collider::testing {

constexpr int64_t kDistT = 32;  // sequence length (a multiple of the selection's align)
constexpr uint64_t kDistSeed = 3;
constexpr const char* kDistPreset = "tinyllama-debug";

inline harness::StepConfig dist_step_config(const std::string& method) {
  harness::StepConfig c;
  c.spec.method = harness::method_from_string(method);
  c.filter_ratio = c.spec.method == harness::Method::kRegular ? 0.0 : 0.5;
  c.spec.score = harness::Score::kSelf;  // each rank selects on its own slice's losses
  c.grad_clip = 0.05;                    // active at every step: clipping must see the reduced gradients
  c.lr = 1e-3;                           // 5 AdamW steps move parameters by ~5e-3
  return c;
}

inline harness::Trainer make_dist_trainer(const std::string& method) {
  return harness::Trainer(models::build_model(models::preset(kDistPreset), models::AttentionImpl::kEager, kDistSeed),
                          dist_step_config(method), torch::kCPU, kDistSeed);
}

// Runs `steps` steps on rank `rank`'s rows of each step's global batch, whose rows are split
// between the ranks as `rows_per_rank` says (rank r: the next rows_per_rank[r] rows); returns per
// step {loss, grad_norm, tokens_kept} (over all ranks when the trainer has a reducer).
inline nlohmann::json run_dist_steps(harness::Trainer& trainer, int steps, const std::vector<int64_t>& rows_per_rank,
                                     int rank) {
  torch::Generator gen = at::detail::createCPUGenerator(kDistSeed * 101 + 7);
  const int64_t V = trainer.model()->config().vocab_size;
  int64_t rows = 0, first = 0;
  for (size_t r = 0; r < rows_per_rank.size(); ++r) {
    if (static_cast<int>(r) < rank) first += rows_per_rank[r];
    rows += rows_per_rank[r];
  }
  nlohmann::json log = nlohmann::json::array();
  for (int s = 0; s < steps; ++s) {
    harness::Batch global = harness::random_batch(rows, kDistT, V, gen, torch::kCPU);
    harness::Batch mine;
    mine.input_ids_BT = global.input_ids_BT.narrow(0, first, rows_per_rank[rank]);
    mine.labels_BT = global.labels_BT.narrow(0, first, rows_per_rank[rank]);
    const harness::StepResult r = trainer.step(mine);
    nlohmann::json j = {{"loss", r.loss}, {"grad_norm", r.grad_norm}, {"tokens_kept", r.tokens_kept}};
    if (r.dist) {
      j["rank_tokens_kept"] = r.dist->rank_tokens_kept;
      j["buckets"] = r.dist->num_buckets;
      j["buckets_overlapped"] = r.dist->buckets_overlapped;
    }
    log.push_back(j);
  }
  return log;
}

}  // namespace collider::testing
