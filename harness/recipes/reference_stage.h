// The reference stage of a training manifest (RHO-1's first step): a reference model trained
// (method regular) on the curated split, or loaded when a run sharing the data directory stored
// it, then the per-token losses of the whole training pool scored once and stored beside the
// shards: DATA/reference/<model>-T<T>-B<B>-s<steps>-lr<lr>-seed<seed>/ holds the model
// (Hugging Face layout), reference.json (its evaluations) and <split>.T<T>.W<windows>.reflosses.f32.
// Runs that share a data directory compute it once (the first holds its lock, the others wait).
#pragma once

#include "harness/components/distributed.h"
#include "harness/components/token_data.h"
#include "harness/components/train_step.h"
#include "harness/config/train_manifest.h"
#include "models/model.h"

#include <functional>
#include <iosfwd>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace collider::harness {

struct ReferenceStage {
  std::string tag;          // <model>-T<T>-B<B>-s<steps>-lr<lr>-seed<seed> (result rows' "reference")
  std::string dir;          // DATA/reference/<tag>
  std::string losses_path;  // the training pool's per-token reference losses
};

// The StepConfig of a training run's steps, the reference run's and each point's: `spec` and
// `filter_ratio`, the run's align, weight decay, gradient clipping and LM head (its learning rate
// follows the run's schedule, RunSpec). The sweeps' steps take theirs from the timing manifest
// (harness/measure/group.cpp).
StepConfig step_config(const TrainSettings& s, const models::MethodSpec& spec, double filter_ratio);

// Mean loss of a model on each evaluation set: (set name, nats).
using Evaluate = std::function<std::vector<std::pair<std::string, double>>(models::CausalLM&)>;

// Rank 0 runs the stage (it writes files beside the shards); the other ranks wait at a barrier.
// `pool`: windows of train_shard to score; `evaluate` runs at the reference run's eval steps.
ReferenceStage run_reference_stage(const TrainSettings& s, const std::string& data_dir, int64_t pool,
                                   const std::shared_ptr<TokenShard>& reference_shard, const TokenShard& train_shard,
                                   const Evaluate& evaluate, ProcessGroup* dist, std::ostream& log);

}  // namespace collider::harness
