// Training manifests (the utility table): `collider run MANIFEST.toml` runs training
// instead of a timing sweep when the manifest has a [train] table.
//
//   name = "tab_utility"
//   [data]   dir = "~/.cache/collider/data"  (scripts/prepare_data.sh output); train = "mix_train";
//            reference = "curated_train"; eval = ["curated_eval", "mix_eval"]
//   [train]  model, seq_len, batch_size, steps, lr, min_lr, warmup_steps, weight_decay, grad_clip,
//            align, eval_every, eval_tokens, eval_batch_size, checkpoint_every, log_every, seed,
//            threads, pool_windows (0 = steps x batch_size x world_size: one pass over scored windows),
//            score ("excess_loss" = RHO-1, default; "reference_loss")
//   [reference]  steps, lr, batch_size: the RHO-1 reference model, trained (regular) on the curated
//            split; its per-token losses on the training pool are stored beside the shards
//            (DATA/reference/<tag>/) and reused by every run and every later invocation
//   [axes]   method = ["regular", "loss_only", "collider"]; attention_grad = ["kept_only",
//            "exact_query"] (collider only); filter_ratio = [0.4] (regular runs once at 0)
// Every run starts from the same initial weights (seed) and sees the same batches; loss_only and
// collider keep the tokens of highest excess loss (current - reference; RHO-1). One JSONL row per
// eval set at every evaluation (step, train_loss, val_loss, val_ppl, eval_set, elapsed_s,
// tokens_seen, tokens_backprop), written as it comes; checkpoints every checkpoint_every steps;
// --resume continues each unfinished run from its checkpoint.
// Data-parallel (a process group from `collider run` under RANK/WORLD_SIZE > 1): each rank trains on
// its own batch_size windows of every step (global batch = world_size x batch_size), gradients are
// all-reduced (GradientReducer), rank 0 alone runs the reference stage and the evaluations (the
// others wait at a barrier) and writes rows (with world_size), checkpoints and progress lines.
// Tests: tests/test_utility.cpp, tests/test_distributed_train.cpp (2 ranks vs one process).
#pragma once

#include <cstdint>
#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

namespace collider::harness {

class ProcessGroup;  // distributed.h

struct TrainSettings {
  std::string data_dir = "~/.cache/collider/data";
  std::string train_split = "mix_train", reference_split = "curated_train";
  std::vector<std::string> eval_splits = {"curated_eval", "mix_eval"};
  std::string model = "tinyllama-mini";
  int64_t seq_len = 256, batch_size = 8, steps = 300;
  double lr = 1e-3, min_lr = 1e-4;   // linear warm-up to lr, cosine down to min_lr
  int64_t warmup_steps = 20;
  double weight_decay = 0.1, grad_clip = 1.0;
  int64_t align = 8;
  int64_t eval_every = 50, eval_tokens = 16384, eval_batch_size = 16;
  int64_t checkpoint_every = 50, log_every = 10;
  int64_t seed = 0, threads = 0;
  int64_t pool_windows = 0;  // 0 = steps x batch_size x world_size
  // Selection score of loss_only / collider: "excess_loss" (RHO-1: current - reference loss) or
  // "reference_loss" (lowest reference loss first; does not depend on the current model's
  // rounding, which the data-parallel equivalence test needs).
  std::string score = "excess_loss";
  int64_t ref_steps = 200, ref_batch_size = 8;
  double ref_lr = 1e-3;
  // Tests (accepted, not advertised): the process behaves as if killed right after the
  // checkpoint of this step of the first unfinished run (no error row; exit code 1).
  int64_t stop_after = 0;
  // Tests: this rank throws at step 2 of the first unfinished run (-1: none).
  int64_t fail_rank = -1;
};

struct TrainPoint {
  std::string method;          // regular | loss_only | collider
  std::string attention_grad;  // kept_only | exact_query for collider, else "none"
  double filter_ratio = 0.0;
  std::string id(const TrainSettings& s) const;  // e.g. tinyllama-mini/T256/B8/f0.4/collider/kept_only
};

struct TrainManifest {
  std::string path, name, description;
  TrainSettings train;
  std::vector<TrainPoint> points;
  std::vector<std::string> overrides;  // echo lines of --set
  std::string resolved_toml;
};

// True when the TOML file has a top-level [train] table (read errors: false; load reports them).
bool is_training_manifest(const std::string& path);
// Throws ManifestError (manifest.h) naming file, key, value and what is allowed.
TrainManifest load_train_manifest(const std::string& path, const std::vector<std::string>& sets = {});

// `collider run` for training manifests; returns the exit code (3: a distributed failure, on every
// rank). `dist`: the process group of a data-parallel run (null: one process); every rank calls this
// with the same arguments; rank 0's out_dir is the one used.
int run_train_command(const std::string& manifest_path, const std::vector<std::string>& sets, std::string out_dir,
                      bool dry_run, bool resume, std::ostream& out, std::ostream& err,
                      std::shared_ptr<ProcessGroup> dist = nullptr);

// Expands "~/" with $HOME.
std::string expand_home(const std::string& path);

}  // namespace collider::harness
