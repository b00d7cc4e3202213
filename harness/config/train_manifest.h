// Training manifests (the utility table): `collider run MANIFEST.toml` trains instead of timing
// when the manifest has a [train] table (recipes/train_run.h runs them).
//
//   name = "tab_utility"
//   [data]   dir = "~/.cache/collider/data"  (scripts/prepare_data.sh output); train = "mix_train";
//            reference = "curated_train"; eval = ["curated_eval", "mix_eval"]
//   [train]  model, seq_len, batch_size, steps, lr, min_lr, warmup_steps, weight_decay, grad_clip,
//            align, eval_every, eval_tokens, eval_batch_size, checkpoint_every, log_every, seed,
//            threads, pool_windows (0 = steps x batch_size x world_size: one pass over scored windows),
//            score ("excess_loss" = RHO-1, default; "reference_loss"), head ("dense", default, or
//            "fused": Collider's fused LM head, collider/head.h)
//   [reference]  steps, lr, batch_size: the RHO-1 reference model, trained (regular) on the curated
//            split (recipes/reference_stage.h)
//   [axes]   method = ["regular", "loss_only", "collider"] (or "forward_drop": the middle layers'
//            forward on a random kept_count of the tokens, every token's loss; 3+ decoder layers);
//            attention_grad = ["kept_only", "exact_query"] (collider only); filter_ratio = [0.4]
//            (regular runs once at 0); selection = ["per_sequence"] (loss_only and collider; add
//            "batch_topk" for RHO-1's own selection: the top tokens of the whole batch, so rows keep
//            different counts)
// Loaded by the shared loader (loader.h): defaults, then the file, then --set; every problem is a
// ManifestError naming the file (or the --set), the key, the value and what is allowed.
// Tests: tests/test_utility.cpp, tests/test_manifest.cpp, tests/test_fuzz_regressions.cpp.
#pragma once

#include "harness/config/loader.h"
#include "models/method.h"

#include <cstdint>
#include <string>
#include <vector>

namespace collider::harness {

struct TrainSettings {
  std::string data_dir = "~/.cache/collider/data";
  std::string train_split = "mix_train", reference_split = "curated_train";
  std::vector<std::string> eval_splits = {"curated_eval", "mix_eval"};
  std::string model = "tinyllama-mini";
  int64_t seq_len = 256, batch_size = 8, steps = 300;
  double lr = 1e-3, min_lr = 1e-4;  // linear warm-up to lr, cosine down to min_lr
  int64_t warmup_steps = 20;
  double weight_decay = 0.1, grad_clip = 1.0;
  int64_t align = 8;
  int64_t eval_every = 50, eval_tokens = 16384, eval_batch_size = 16;
  int64_t checkpoint_every = 50, log_every = 10;
  int64_t seed = 0, threads = 0;
  int64_t pool_windows = 0;  // 0 = steps x batch_size x world_size
  std::string head = "dense";  // dense | fused: the LM head of the trained points (StepConfig::fused_head)
  // Selection score of loss_only / collider (models::Score): "excess_loss" (RHO-1: current -
  // reference loss) or "reference_loss" (lowest reference loss first; does not depend on the
  // current model's rounding, which the data-parallel equivalence test needs). Parsed into each
  // point's MethodSpec.
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
  // regular | loss_only | collider | forward_drop; attention_grad (collider); train.score and the
  // selection policy (loss_only, collider). Parsed at load.
  models::MethodSpec spec;
  double filter_ratio = 0.0;
  // e.g. tinyllama-mini/T256/B8/f0.4/collider/kept_only; batch_topk selection adds /batch_topk
  std::string id(const TrainSettings& s) const;
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
// Throws ManifestError naming file, key, value and what is allowed.
TrainManifest load_train_manifest(const std::string& path, const std::vector<std::string>& sets = {});

}  // namespace collider::harness
