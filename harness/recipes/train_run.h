// Training runs (the utility table): `collider run MANIFEST.toml` for a manifest with a [train]
// table (config/train_manifest.h: its keys). First the reference stage (the RHO-1 reference
// model, trained regular on the curated split; its per-token losses on the training pool are
// stored beside the shards (DATA/reference/<tag>/) and reused by every run and every later
// invocation), then one training run per point.
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

#include "harness/config/train_manifest.h"

#include <cstdint>
#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

namespace collider::harness {

class ProcessGroup;  // distributed.h

// `collider run` for training manifests; returns the exit code (3: a distributed failure, on every
// rank). `dist`: the process group of a data-parallel run (null: one process); every rank calls this
// with the same arguments; rank 0's out_dir is the one used.
int run_train_command(const std::string& manifest_path, const std::vector<std::string>& sets, std::string out_dir,
                      bool dry_run, bool resume, std::ostream& out, std::ostream& err,
                      std::shared_ptr<ProcessGroup> dist = nullptr);

// Expands "~/" with $HOME.
std::string expand_home(const std::string& path);

}  // namespace collider::harness
