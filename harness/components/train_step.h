// The training step of every method: forward, per-token loss, token selection, the one added
// line (Collider's graph rewrite, or the masked oracle), backward (forward_drop instead drops
// tokens from the middle layers' forward, keeps every token's loss and rewrites nothing), gradient all-reduce (only with
// a GradientReducer: data-parallel runs, harness/components/distributed.h), gradient clipping, AdamW.
// fp32 on CPU; bf16 autocast on CUDA (parameters and optimizer state stay fp32).
// Each phase is timed (Timer: steady clock on CPU, CUDA events on GPU), optionally per layer
// (LayerTimer markers), and bracketed by NVTX / trace ranges with the same names.
// Legend: B batch, T sequence, V vocab, N kept tokens per sequence.
// Tests: tests/test_train_step.cpp (build-harness/tests/test_train_step).
#pragma once

#include "harness/components/batch.h"
#include "harness/components/distributed.h"
#include "harness/components/layer_timing.h"
#include "harness/components/ranges.h"
#include "harness/components/timer.h"
#include "models/method.h"
#include "models/model.h"

#include <collider/collider.h>

#include <torch/torch.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace collider::harness {

// The method words (models/method.h, shared with the FLOP formulas and the benchmarks), by the
// names the harness has always used for them.
using models::Method;
using models::MethodSpec;
using models::Score;
using models::method_from_string;
using models::to_string;
using models::uses_attention_grad;

struct StepConfig {
  // method, attention_grad, selection policy and scores. Score::kExcessLoss and kReferenceLoss
  // need Batch::ref_loss_BT.
  MethodSpec spec;
  // Fraction of tokens dropped (ignored by regular): from the loss and the backward (loss_only,
  // collider, masked), or from the middle layers' forward (forward_drop).
  double filter_ratio = 0.0;
  int64_t align = 8;  // drop count per row rounded up to a multiple of this
  double lr = 3e-4, weight_decay = 0.1, beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double grad_clip = 1.0;      // max global grad norm; <= 0 disables clipping
  bool bf16_autocast = false;  // CUDA only: forward under bf16 autocast
  bool layer_timing = false;   // install per-layer markers
  // The LM head: false, the model's own (logits [B, T, V], then the per-token cross-entropy);
  // true, Collider's fused head (collider/head.h) on the final hidden states: every token scored
  // with no [B, T, V] logits, only the kept ones backpropagated. Manifest key run.head.
  bool fused_head = false;
  // collider: the check of a step against mask_backward on first use and every check_every-th
  // step (collider::FilterOptions::check_every); the timing sweeps set 0, training runs keep it.
  int64_t check_every = collider::kDefaultCheckEvery;
};

struct StepResult {
  // With a reducer, loss / tokens / tokens_kept are over every rank (`dist` has each rank's).
  double loss = 0.0;         // the loss that was backpropagated (mean over kept tokens)
  double loss_all = 0.0;     // mean over every labelled token (the regular loss; compares methods)
  double grad_norm = 0.0;    // global grad norm before clipping (of the reduced gradients)
  int64_t tokens = 0;        // B * T
  int64_t tokens_kept = 0;   // kept positions in the batch (forward_drop: every labelled one)
  int64_t kept_per_seq = 0;  // N when every row keeps the same count (per_sequence), else -1 (ragged)
  // forward_drop: tokens per row the middle decoder layers saw (kept_count(T, filter_ratio,
  // align)); 0 for every other method (their layers see all T).
  int64_t middle_tokens_per_seq = 0;
  std::vector<int64_t> kept_per_row;  // [B] this rank's kept count of every row
  double fwd_ms = 0.0;                // model forward + per-token loss (forward_drop: + drawing the subset)
  double filter_ms = 0.0;             // selection + masked-mean loss + graph rewrite (select_ms + rewrite_ms + rest)
  double select_ms = 0.0;             // scores + select_tokens
  double rewrite_ms = 0.0;            // filter_backward / mask_backward (collider, masked)
  double bwd_ms = 0.0;                // loss.backward()
  double allreduce_ms =
      0.0;  // GradientReducer begin + finish (bucket all-reduces that overlap bwd count in bwd_ms); 0 without one
  double optim_ms = 0.0;            // grad clipping + AdamW step
  double step_ms = 0.0;             // all of the above
  std::vector<LayerTime> layers;    // when StepConfig::layer_timing
  collider::FilterStats filter;     // collider / masked
  std::optional<ReduceStats> dist;  // with a reducer: per-rank losses and kept counts
};

class Trainer {
 public:
  // The model is moved to `device`; `seed` drives the random scores. ranges may be null.
  Trainer(models::CausalLM model, StepConfig cfg, torch::Device device, uint64_t seed = 0,
          RangeRecorder* ranges = nullptr);
  ~Trainer();

  // One step. Parameter gradients of this step stay in .grad() until the next step starts.
  StepResult step(const Batch& batch);

  // Switches the method and filter ratio of later steps. An interleaved timing group
  // (harness/measure/group.h) measures all its points on one model, optimizer and traced plan
  // this way; the plan depends only on the model, never on the method or ratio.
  void set_method(const MethodSpec& spec, double filter_ratio);

  models::CausalLM& model() { return model_; }
  torch::optim::AdamW& optimizer() { return *optimizer_; }
  const StepConfig& config() const { return cfg_; }
  const torch::Device& device() const { return device_; }
  Timer& timer() { return *timer_; }
  LayerTimer* layer_timer() { return layer_timer_.get(); }
  // Data parallelism: gradients are all-reduced after backward (before clipping) on every later
  // step; the reducer's constructor has already made the parameters equal to rank 0's. Null
  // detaches. `batch` in step() is then this rank's slice of the global batch.
  void set_reducer(std::shared_ptr<GradientReducer> reducer) { reducer_ = std::move(reducer); }
  GradientReducer* reducer() const { return reducer_.get(); }
  // The traced plan (collider / masked), built on the first step of a given batch shape.
  const collider::Plan* plan() const { return plan_ ? &*plan_ : nullptr; }

  // Keep mask this step would use for the given per-token losses (exposed for tests); every
  // labelled position for regular and forward_drop.
  torch::Tensor select(const torch::Tensor& loss_BT, const Batch& batch);

  // forward_drop: the tokens per row the middle layers see for sequences of T (throws
  // std::invalid_argument when filter_ratio and align leave none), and the next subset, int64
  // [B, N] on the device. Draw k (0, 1, ...; each step draws one) comes from a CPU generator
  // seeded from (`seed`, k), so set_draws(s) makes a run resumed at step s draw what the
  // uninterrupted run drew (training_loop.cpp calls it). Exposed for tests, which replay a step
  // with the same subset.
  int64_t middle_tokens(int64_t T) const;
  torch::Tensor draw_middle_tokens(int64_t B, int64_t T);
  void set_draws(int64_t draws) { drop_draws_ = draws; }

 private:
  // The forward and every token's loss: through the model's own head (loss_BT from the logits), or
  // through the fused head (StepConfig::fused_head): where the selection reads the model's own
  // per-token losses, `head` holds the scores of every row and builds the loss (the kept rows'
  // logits recomputed in the backward); otherwise the head waits for the keep mask (hidden_BTD,
  // weight_VD, bias_V) and head_loss runs collider::fused_head_loss (their gradient made in the
  // forward, no recompute), which fills loss_BT.
  struct Scored {
    torch::Tensor loss_BT;
    std::optional<collider::ScoredHead> head;
    torch::Tensor hidden_BTD, weight_VD, bias_V;
  };
  Scored score(const torch::Tensor& input_ids_BT, const torch::Tensor& labels_BT, const torch::Tensor& middle_BN);
  // The step's loss, the mean over the kept tokens (keep_BT).
  torch::Tensor head_loss(Scored& scored, const torch::Tensor& labels_BT, const torch::Tensor& keep_BT);
  void ensure_plan(int64_t B, int64_t T);
  // Refuses a filter ratio outside [0, 1) and forward_drop on fewer than 3 decoder layers.
  void check_method(const MethodSpec& spec, double filter_ratio) const;

  // step()'s phases, in order, each in its trace range (train_step.cpp lists what each times).
  struct Marks;  // the timer's marks between the phases
  struct Filtered {
    torch::Tensor keep_BT;  // bool [B, T]: the kept tokens
    torch::Tensor loss;     // the mean loss over them, rewritten for the filtered backward
  };
  Batch on_device(const Batch& batch) const;  // checks the shapes
  Scored run_forward(const Batch& batch, StepResult& r);
  Filtered run_filter(Scored& scored, const Batch& batch, StepResult& r, Marks& mk);
  void allreduce_begin(const Filtered& f, int64_t tokens);  // with a reducer
  void run_backward(const torch::Tensor& loss);
  void allreduce_finish(StepResult& r);  // with a reducer
  void run_optimizer(StepResult& r);
  void write_times(const Marks& mk, StepResult& r);
  void write_counts(const Batch& batch, const torch::Tensor& loss_BT, const Filtered& f, StepResult& r) const;

  models::CausalLM model_;
  StepConfig cfg_;
  torch::Device device_;
  RangeRecorder* ranges_;
  std::unique_ptr<Timer> timer_;
  std::unique_ptr<LayerTimer> layer_timer_;
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  std::optional<collider::Plan> plan_;
  std::shared_ptr<GradientReducer> reducer_;
  torch::Generator score_gen_;
  int64_t drop_draws_ = 0;  // forward_drop's middle-layer subsets drawn so far
  uint64_t seed_;
};

// A batch of uniformly random tokens (timing runs), deterministic in `gen`: labels are the
// inputs shifted by one with a random final token.
Batch random_batch(int64_t B, int64_t T, int64_t vocab_size, torch::Generator& gen, const torch::Device& device);

// RAII bf16 autocast on CUDA (restores the previous state, clears the cast cache on exit).
class AutocastScope {
 public:
  explicit AutocastScope(bool enabled);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  bool enabled_;
  bool prev_enabled_ = false;
  at::ScalarType prev_dtype_ = at::kBFloat16;
};

}  // namespace collider::harness
