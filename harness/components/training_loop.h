// The step loop of one training run, shared by the training recipe (harness/recipes/train_run.cpp)
// and its reference stage (harness/recipes/reference_stage.cpp): learning-rate schedule, progress
// lines, periodic evaluation and checkpoints (replaced by renames only, so a kill always leaves one
// complete checkpoint), resume from the newest one, and the data-parallel rules (rank 0 writes and
// evaluates; every rank trains on its own windows).
#pragma once

#include "harness/components/distributed.h"
#include "harness/components/token_data.h"
#include "harness/components/train_step.h"
#include "harness/config/train_manifest.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <stdexcept>
#include <string>
#include <vector>

namespace collider::harness {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0);

// train.stop_after (tests): stands for a killed process.
struct SimulatedKill : std::runtime_error {
  SimulatedKill() : std::runtime_error("stopped after a checkpoint (train.stop_after, tests)") {}
};

// What a checkpoint carries besides the model and the optimizer.
struct RunState {
  int64_t step = 0;  // optimizer steps done
  double elapsed_s = 0.0, tokens_seen = 0.0, tokens_backprop = 0.0;
  // The training-loss sums since the last logged step: kept in the checkpoint so that a resumed
  // run logs the same means as an uninterrupted one when checkpoint_every is not a multiple of
  // log_every.
  double log_loss_sum = 0.0, log_kept_sum = 0.0;
  int64_t log_steps = 0;
  // The last step's kept count per row (this rank's rows; they differ under batch_topk). Not
  // checkpointed: every logged row follows a step of the process that logs it.
  std::vector<int64_t> last_kept_per_row;
  nlohmann::json to_json() const;
  static RunState from_json(const nlohmann::json& j);
};

struct RunSpec {
  std::string label;  // progress-line prefix
  StepConfig step_cfg;
  const WindowLoader* loader = nullptr;
  const RefLosses* ref = nullptr;
  int64_t steps = 0, warmup_steps = 0;
  double lr = 0, min_lr = 0;
  std::string ckpt_dir;
  bool resume = false;
  bool may_stop = false;         // honours train.stop_after (training points, not the reference stage)
  ProcessGroup* dist = nullptr;  // data-parallel: the trainer has a GradientReducer on it
};

// Rank 0's value on every rank (a decision only rank 0 can make, e.g. from files only it reads);
// without a process group the value itself.
int64_t from_rank0(ProcessGroup* pg, int64_t value, const char* what);
std::string from_rank0(ProcessGroup* pg, const std::string& value, const char* what);

// Trains `spec.steps` steps from the checkpoint if one exists (resume) or from scratch; calls
// on_log(state, train_loss, train_loss_kept, lr) every log_every-th step (means since the last
// call; train_loss over every token, train_loss_kept over the back-propagated ones) and
// on_eval(state, lr) every eval_every-th step; both also at the last step.
void train_loop(const TrainSettings& s, RunSpec spec, Trainer& tr,
                const std::function<void(const RunState&, double, double, double)>& on_log,
                const std::function<void(const RunState&, double)>& on_eval, std::ostream& log);

// A finished run's checkpoint is moved to DIR.done and then removed, so that a kill half-way
// through the removal never leaves a half-deleted directory under a name resume would read.
void remove_checkpoint(const std::string& dir);

}  // namespace collider::harness
