// Data-parallel training on PyTorch's own distributed engine (c10d, shipped in libtorch): a
// process group (Gloo on CPU, NCCL on CUDA) set up from the variables torchrun and Slurm set
// (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) with a c10d::TCPStore served by rank 0,
// and a GradientReducer that all-reduces parameter gradients in flattened buckets after the
// (filtered) backward. Every collective has a bounded timeout; a dead or hung peer becomes a
// DistributedError naming this rank and what failed. Built only with COLLIDER_DISTRIBUTED (CMake
// finds the gloo headers); without it, init_process_group says how to enable it.
// Launch: scripts/launch.sh N MANIFEST. Tests: tests/test_distributed.cpp (label distributed).
#pragma once

#include <torch/torch.h>

#include "collider/torch_compat.h"

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace collider::harness {

// A collective or rendezvous that failed: a peer died, hung past the timeout, or never came up.
// what() names this rank and the operation; a run that sees it must end (exit non-zero).
class DistributedError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The launch variables (torchrun / Slurm / scripts/launch.sh).
struct DistEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  // Bound on rendezvous and on every collective (a hung peer ends the run after this long).
  // COLLIDER_DIST_TIMEOUT_S, default 300 s.
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
};

// The launch variables of this process, or nullopt when WORLD_SIZE is unset (a single-process
// run). Throws std::invalid_argument naming the variable when one is missing or malformed
// (RANK outside [0, WORLD_SIZE), a port outside 1..65535, ...).
std::optional<DistEnv> dist_env_from_environment();

// True when this build has c10d process groups (CMake option COLLIDER_DISTRIBUTED).
bool distributed_available();

// One c10d process group (a Gloo or NCCL backend over a TCPStore); every rank calls the same
// collectives in the same order. Collectives block until done and throw DistributedError.
class ProcessGroup {
 public:
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return env_.rank; }
  int world_size() const { return env_.world_size; }
  const DistEnv& env() const { return env_; }
  const std::string& backend() const { return backend_; }  // "gloo" or "nccl"

  // In-place sums over ranks (tensors on the group's device).
  void all_reduce_sum(std::vector<torch::Tensor>& tensors, const char* what);
  // The same, started now and finished by wait() (every rank must start them in the same order).
  struct Pending;
  std::shared_ptr<Pending> start_all_reduce_sum(torch::Tensor& tensor);
  void wait(Pending& pending, const char* what);
  // In-place broadcast of rank `root`'s values.
  void broadcast(std::vector<torch::Tensor>& tensors, int root, const char* what);
  void barrier(const char* what);

 private:
  friend std::shared_ptr<ProcessGroup> init_process_group(const DistEnv&, const torch::Device&);
  struct Impl;
  ProcessGroup(DistEnv env, std::string backend, std::unique_ptr<Impl> impl);
  DistEnv env_;
  std::string backend_;
  std::unique_ptr<Impl> impl_;
};

// Connects to the other ranks: rank 0 serves the TCPStore at MASTER_ADDR:MASTER_PORT, every rank
// joins within env.timeout. Backend: NCCL when `device` is CUDA and the build has it, else Gloo.
// Throws DistributedError (rendezvous failed, with the address) or std::runtime_error when the
// build lacks COLLIDER_DISTRIBUTED.
std::shared_ptr<ProcessGroup> init_process_group(const DistEnv& env, const torch::Device& device);

// What one reduction did: the per-rank numbers every rank now knows, and the time it took.
struct ReduceStats {
  double allreduce_ms = 0.0;       // wall time of begin() + finish() (host clock): wait_ms + bucket_ms
  double wait_ms = 0.0;            // the first, tiny all-reduce: mostly waiting for the slowest rank
  double bucket_ms = 0.0;          // after backward: start the rest, wait for all buckets, copy back
  int64_t buckets_overlapped = 0;  // buckets whose all-reduce started during backward
  int64_t num_buckets = 0;
  int64_t bytes = 0;                      // gradient bytes all-reduced per rank
  std::vector<double> rank_loss;          // per rank: its loss (mean over its kept tokens)
  std::vector<int64_t> rank_tokens_kept;  // per rank: kept positions
  std::vector<int64_t> rank_tokens;       // per rank: positions in its batch slice
  double loss = 0.0;                      // mean over every kept token of every rank
  int64_t tokens_kept = 0, tokens = 0;    // sums over ranks
};

struct ReducerOptions {
  int64_t bucket_bytes = 25 * 1024 * 1024;  // flattened gradients per all-reduce (as DDP's 25 MiB)
  // Start each bucket's all-reduce from a hook as soon as backward has produced all of its
  // gradients (as DDP), instead of after backward. COLLIDER_DIST_OVERLAP=0 turns it off.
  bool overlap_backward = true;
};

// All-reduces the gradients of `params` so that every rank holds the gradient of the loss over
// all ranks' kept tokens together. Each rank's loss is a mean over its own kept tokens (n_r of
// them), so the global mean's gradient is sum_r (n_r / N) grad_r with N = sum_r n_r: reduce()
// first sums the per-rank (loss, n_r, tokens) in one small all-reduce, scales the local gradients
// by n_r / N and sums them in buckets (last parameters first, as backward produces them). With
// equal kept counts (per_sequence selection, equal batch slices) that is the plain average and
// equals one process on the concatenated batch. The constructor broadcasts rank 0's parameters
// so that every replica starts equal. Parameters shared by tying are reduced once.
// With overlap_backward, hooks on the parameters' gradient accumulators start bucket b's
// all-reduce once its gradients exist and buckets 0..b-1 have started (the same order on every
// rank); begin() must then come before backward.
class GradientReducer {
 public:
  GradientReducer(std::shared_ptr<ProcessGroup> pg, const std::vector<torch::Tensor>& params,
                  ReducerOptions options = {});
  ~GradientReducer();
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  // Before backward (the loss and kept count are known): sums the per-rank numbers (this is
  // where ranks wait for the slowest) and arms the overlap hooks.
  void begin(double local_loss, int64_t local_tokens_kept, int64_t local_tokens);
  // After backward, before clipping and the optimizer step: starts the buckets not started yet,
  // waits for all, writes the reduced gradients. Parameters without a gradient on this rank take
  // part with zeros (and get the reduced gradient).
  ReduceStats finish();
  // begin() + finish() after backward (no overlap).
  ReduceStats reduce(double local_loss, int64_t local_tokens_kept, int64_t local_tokens);

  bool overlaps_backward() const { return options_.overlap_backward; }
  ProcessGroup& process_group() { return *pg_; }
  const std::shared_ptr<ProcessGroup>& process_group_ptr() const { return pg_; }

 private:
  void mark_ready(size_t param_index);  // from the gradient-accumulator hooks
  void start_ready_buckets(bool all);   // in bucket order; all = also the incomplete ones
  std::shared_ptr<ProcessGroup> pg_;
  std::vector<torch::Tensor> params_;         // unique, in reduction order
  std::vector<std::vector<size_t>> buckets_;  // indices into params_
  std::vector<size_t> bucket_of_;             // param index -> bucket
  ReducerOptions options_;
  std::vector<NodePtr> accumulators_;  // kept alive so hooks persist
  std::vector<uintptr_t> hook_keys_;
  // State of the step between begin() and finish().
  std::mutex mutex_;
  bool armed_ = false;
  double scale_ = 1.0;  // n_r / N
  ReduceStats stats_;
  double t_begin_ms_ = 0.0, begin_ms_ = 0.0;
  std::vector<char> param_ready_;
  std::vector<int64_t> bucket_ready_count_;
  size_t next_bucket_ = 0;  // buckets [0, next_bucket_) started
  std::vector<torch::Tensor> flats_;
  std::vector<std::shared_ptr<ProcessGroup::Pending>> pending_;
  int64_t buckets_started_in_backward_ = 0;
};

// Runs `fn` (e.g. a checkpoint save) on rank 0 only, then waits until it is done on every rank;
// without a process group it just runs `fn`. Checkpoints are world-size independent (every
// replica holds the same parameters and optimizer state), so one copy is written.
void run_on_rank0(ProcessGroup* pg, const std::function<void()>& fn);

}  // namespace collider::harness
