// Training step (train_step.h). Phase order and what each timing covers:
//   fwd      model forward + per-token loss (bf16 autocast on CUDA); forward_drop: drawing the
//            middle layers' token subset, then the forward with it
//   filter   scores + select_tokens, masked-mean loss, filter_backward / mask_backward
//   bwd      loss.backward()
//   allreduce  GradientReducer::begin (before bwd: per-rank counts, the wait for the slowest rank)
//            + finish (after bwd: the buckets not overlapped with it, copy back); data-parallel
//            runs only; before clipping, so that clipping and AdamW see every rank's kept tokens
//   optimizer  clip_grad_norm_ + AdamW step (gradients are set to none at the start of the next step)
// Trainer::step runs them as one function each, in this order: run_forward, run_filter,
// allreduce_begin, run_backward, allreduce_finish, run_optimizer, each between two timer marks.
#include "harness/components/train_step.h"

#include <ATen/autocast_mode.h>

#include <fmt/format.h>

#include <stdexcept>
#include <unordered_set>

namespace collider::harness {

AutocastScope::AutocastScope(bool enabled) : enabled_(enabled) {
  if (!enabled_) return;
  prev_enabled_ = at::autocast::is_autocast_enabled(at::kCUDA);
  prev_dtype_ = at::autocast::get_autocast_dtype(at::kCUDA);
  at::autocast::set_autocast_enabled(at::kCUDA, true);
  at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
  at::autocast::increment_nesting();
}

AutocastScope::~AutocastScope() {
  if (!enabled_) return;
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(at::kCUDA, prev_enabled_);
  at::autocast::set_autocast_dtype(at::kCUDA, prev_dtype_);
}

Batch random_batch(int64_t B, int64_t T, int64_t vocab_size, torch::Generator& gen, const torch::Device& device) {
  auto ids = torch::randint(0, vocab_size, {B, T + 1}, gen, torch::kLong);
  Batch b;
  b.input_ids_BT = ids.narrow(1, 0, T).contiguous().to(device);
  b.labels_BT = ids.narrow(1, 1, T).contiguous().to(device);
  return b;
}

Trainer::Trainer(models::CausalLM model, StepConfig cfg, torch::Device device, uint64_t seed, RangeRecorder* ranges)
    : model_(std::move(model)),
      cfg_(std::move(cfg)),
      device_(device),
      ranges_(ranges),
      timer_(make_timer(device)),
      score_gen_(at::detail::createCPUGenerator(seed)),
      seed_(seed) {
  check_method(cfg_.spec, cfg_.filter_ratio);
  if (cfg_.bf16_autocast && !device_.is_cuda()) {
    throw std::invalid_argument("Trainer: bf16 autocast is for CUDA devices; on CPU the step runs in fp32");
  }
  model_->to(device_);
  model_->train();
  if (cfg_.layer_timing) {
    layer_timer_ = std::make_unique<LayerTimer>(timer_.get(), ranges_);
    layer_timer_->install(model_);
    // One tiny forward (B = 1, T = 2, no grad, not recorded) so that the boundary names are known
    // before the first timed step and its trace ranges carry the right names.
    layer_timer_->set_recording(false);
    {
      torch::NoGradGuard ng;
      model_->forward(torch::zeros({1, 2}, torch::TensorOptions().dtype(torch::kLong).device(device_)));
    }
    layer_timer_->set_recording(true);
  }
  // AdamW with weight decay on matrices only (norm gains and biases are not decayed);
  // parameters shared by tying appear once.
  std::vector<torch::Tensor> decay, no_decay;
  std::unordered_set<const void*> seen;
  for (auto& p : model_->parameters()) {
    if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
    (p.dim() >= 2 ? decay : no_decay).push_back(p);
  }
  auto opts =
      torch::optim::AdamWOptions(cfg_.lr).betas({cfg_.beta1, cfg_.beta2}).eps(cfg_.eps).weight_decay(cfg_.weight_decay);
  auto opts_nd = opts;
  opts_nd.weight_decay(0.0);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(opts));
  groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(opts_nd));
  optimizer_ = std::make_unique<torch::optim::AdamW>(std::move(groups), opts);
}

void Trainer::check_method(const MethodSpec& spec, double filter_ratio) const {
  if (!(filter_ratio >= 0.0 && filter_ratio < 1.0)) {
    throw std::invalid_argument(fmt::format("Trainer: filter_ratio {} is outside [0, 1)", filter_ratio));
  }
  if (spec.method == Method::kForwardDrop && model_->config().num_layers < 3) {
    throw std::invalid_argument(
        fmt::format("Trainer: forward_drop needs at least 3 decoder layers (the first and the last see every token); "
                    "model '{}' has {}: use a preset with more layers (the -mini presets have 4)",
                    model_->config().name, model_->config().num_layers));
  }
}

void Trainer::set_method(const MethodSpec& spec, double filter_ratio) {
  check_method(spec, filter_ratio);
  cfg_.spec = spec;
  cfg_.filter_ratio = filter_ratio;
}

Trainer::~Trainer() {
  // The hook captures the layer timer; leave the model hook-free if it outlives us.
  if (layer_timer_) model_->set_boundary_hook(nullptr);
}

void Trainer::ensure_plan(int64_t B, int64_t T) {
  if (plan_) return;
  const int64_t V = model_->config().vocab_size;
  if (layer_timer_) layer_timer_->set_recording(false);
  torch::Generator gen = at::detail::createCPUGenerator(seed_ ^ 0x5eedULL);
  auto loss_on_random_batch = [&](int64_t b, int64_t t) {
    Batch rb = random_batch(b, t, V, gen, device_);
    // The same graph as a step's loss; the mask values do not change its structure.
    const auto all_BT = torch::ones_like(rb.labels_BT, torch::kBool);
    Scored scored = score(rb.input_ids_BT, rb.labels_BT, torch::Tensor());
    return head_loss(scored, rb.labels_BT, all_BT);
  };
  try {
    plan_ = collider::trace_plan(loss_on_random_batch);
  } catch (...) {
    if (layer_timer_) layer_timer_->set_recording(true);
    throw;
  }
  if (layer_timer_) layer_timer_->set_recording(true);
  optimizer_->zero_grad(/*set_to_none=*/true);  // tracing must leave no gradient behind
  (void)B;
  (void)T;
}

Trainer::Scored Trainer::score(const torch::Tensor& input_ids_BT, const torch::Tensor& labels_BT,
                               const torch::Tensor& middle_BN) {
  AutocastScope ac(cfg_.bf16_autocast);
  Scored out;
  if (!cfg_.fused_head) {
    out.loss_BT = models::token_losses(model_->forward(input_ids_BT, middle_BN), labels_BT);
    return out;
  }
  auto x_BTD = model_->hidden(input_ids_BT, middle_BN);
  torch::Tensor w_VD = model_->head_weight(), b_V = model_->head_bias();
  if (cfg_.bf16_autocast) {  // what autocast does to a linear layer: both operands in bfloat16
    x_BTD = x_BTD.to(torch::kBFloat16);
    w_VD = w_VD.to(torch::kBFloat16);
    if (b_V.defined()) b_V = b_V.to(torch::kBFloat16);
  }
  if (models::uses_selection(cfg_.spec.method) &&
      (cfg_.spec.score == Score::kSelf || cfg_.spec.score == Score::kExcessLoss)) {
    // The selection reads the model's own per-token losses: score every row now, and the loss
    // recomputes the kept rows' logits in the backward (RHO-1's order).
    out.head = collider::score_head(x_BTD, w_VD, labels_BT, {}, b_V);
    out.loss_BT = out.head->token_loss;
  } else {  // the keep mask does not depend on them: one fused_head_loss once it is known
    out.hidden_BTD = x_BTD;
    out.weight_VD = w_VD;
    out.bias_V = b_V;
  }
  return out;
}

torch::Tensor Trainer::head_loss(Scored& scored, const torch::Tensor& labels_BT, const torch::Tensor& keep_BT) {
  if (!cfg_.fused_head) return models::masked_mean_loss(scored.loss_BT, keep_BT);
  const double count = std::max<double>(keep_BT.sum().item<double>(), 1.0);
  if (scored.head) return scored.head->loss(keep_BT, count);
  collider::HeadOptions o;
  o.divisor = count;
  auto r = collider::fused_head_loss(scored.hidden_BTD, scored.weight_VD, labels_BT, keep_BT, o, scored.bias_V);
  scored.loss_BT = r.token_loss;
  return r.loss;
}

torch::Tensor Trainer::select(const torch::Tensor& loss_BT, const Batch& batch) {
  torch::NoGradGuard no_grad;
  auto valid_BT = batch.labels_BT != -100;
  const MethodSpec& spec = cfg_.spec;
  if (!models::uses_selection(spec.method)) return valid_BT;
  torch::Tensor scores_BT;
  switch (spec.score) {
    case Score::kSelf:
      scores_BT = loss_BT.detach();
      break;
    case Score::kExcessLoss:
    case Score::kReferenceLoss: {
      TORCH_CHECK(batch.ref_loss_BT.has_value(), "Trainer: score '", to_string(spec.score),
                  "' needs Batch::ref_loss_BT (reference per-token losses, e.g. from `collider score`)");
      auto ref_BT = batch.ref_loss_BT->to(loss_BT.device());
      scores_BT = spec.score == Score::kExcessLoss ? collider::excess_loss(loss_BT, ref_BT) : -ref_BT;
      break;
    }
    case Score::kRandom:
      scores_BT = torch::rand(loss_BT.sizes(), score_gen_, torch::kFloat).to(loss_BT.device());
      break;
  }
  collider::SelectOptions so;
  so.policy = spec.policy;
  so.align = cfg_.align;
  so.valid_BT = valid_BT;
  return collider::select_tokens(scores_BT, cfg_.filter_ratio, so);
}

int64_t Trainer::middle_tokens(int64_t T) const {
  const int64_t N = collider::kept_count(T, cfg_.filter_ratio, cfg_.align);
  if (N < 1) {
    throw std::invalid_argument(
        fmt::format("Trainer: forward_drop at filter_ratio {} with align {} leaves no token of seq_len {} for the "
                    "middle layers; lower the ratio or the alignment, or raise seq_len",
                    cfg_.filter_ratio, cfg_.align, T));
  }
  return N;
}

torch::Tensor Trainer::draw_middle_tokens(int64_t B, int64_t T) {
  const int64_t N = middle_tokens(T);
  const uint64_t k = static_cast<uint64_t>(drop_draws_++);
  torch::Generator gen = at::detail::createCPUGenerator((seed_ ^ 0xd20bULL) + 0x9e3779b97f4a7c15ULL * (k + 1));
  auto middle_BN = models::random_middle_tokens(B, T, N, gen, torch::kCPU);
  if (!device_.is_cuda()) return middle_BN;
  // A copy from pageable host memory waits for the device (a host sync per step); from pinned
  // memory it is queued on the stream like the step's kernels.
  return middle_BN.pin_memory().to(device_, /*non_blocking=*/true);
}

// The timer's marks between a step's phases (Timer::mark), from which StepResult's times come.
struct Trainer::Marks {
  int64_t start = 0, fwd = 0, select = 0, loss = 0, filter = 0, begin = 0, bwd = 0, reduce = 0, opt = 0;
};

StepResult Trainer::step(const Batch& batch_in) {
  const Batch batch = on_device(batch_in);
  const int64_t B = batch.input_ids_BT.size(0), T = batch.input_ids_BT.size(1);
  if (uses_attention_grad(cfg_.spec.method)) ensure_plan(B, T);
  // Gradients of the previous step are dropped here (not after it) so that they stay readable
  // between steps; set_to_none frees them before this step's forward.
  optimizer_->zero_grad(/*set_to_none=*/true);

  StepResult r;
  Marks mk;
  timer_->reset();
  ScopedRange step_range(ranges_, "step");
  mk.start = timer_->mark();
  Scored scored = run_forward(batch, r);
  mk.fwd = timer_->mark();
  const Filtered f = run_filter(scored, batch, r, mk);
  mk.filter = timer_->mark();
  if (reducer_) allreduce_begin(f, B * T);
  mk.begin = reducer_ ? timer_->mark() : mk.filter;
  run_backward(f.loss);
  mk.bwd = timer_->mark();
  if (reducer_) allreduce_finish(r);
  mk.reduce = reducer_ ? timer_->mark() : mk.bwd;  // allreduce_ms is exactly 0 without a reducer
  run_optimizer(r);
  mk.opt = timer_->mark();
  timer_->synchronize();
  step_range.close();
  write_times(mk, r);
  write_counts(batch, scored.loss_BT, f, r);
  return r;
}

Batch Trainer::on_device(const Batch& batch_in) const {
  TORCH_CHECK(batch_in.input_ids_BT.dim() == 2 && batch_in.labels_BT.sizes() == batch_in.input_ids_BT.sizes(),
              "Trainer::step: input_ids and labels must both be [B, T], got ", batch_in.input_ids_BT.sizes(), " and ",
              batch_in.labels_BT.sizes());
  Batch batch = batch_in;
  batch.input_ids_BT = batch.input_ids_BT.to(device_);
  batch.labels_BT = batch.labels_BT.to(device_);
  return batch;
}

Trainer::Scored Trainer::run_forward(const Batch& batch, StepResult& r) {
  ScopedRange rg(ranges_, "fwd");
  if (layer_timer_) layer_timer_->forward_begin();
  Scored scored;
  {
    // forward_drop: the middle layers' subset, N per row (int64 [B, N]); undefined = all tokens.
    torch::Tensor middle_BN;
    if (cfg_.spec.method == Method::kForwardDrop) {
      middle_BN = draw_middle_tokens(batch.input_ids_BT.size(0), batch.input_ids_BT.size(1));
      r.middle_tokens_per_seq = middle_BN.size(1);
    }
    scored = score(batch.input_ids_BT, batch.labels_BT, middle_BN);
  }
  if (layer_timer_) layer_timer_->forward_end();
  return scored;
}

Trainer::Filtered Trainer::run_filter(Scored& scored, const Batch& batch, StepResult& r, Marks& mk) {
  Filtered f;
  ScopedRange rg(ranges_, "filter");
  {
    ScopedRange rs(ranges_, "filter.select");
    // (The fused head without its scores yet: a selection that does not read them.)
    const torch::Tensor& loss_BT = scored.loss_BT;
    f.keep_BT = select(loss_BT.defined() ? loss_BT : torch::zeros_like(batch.labels_BT, torch::kFloat), batch);
  }
  mk.select = timer_->mark();
  f.loss = head_loss(scored, batch.labels_BT, f.keep_BT);  // the fused head fills scored.loss_BT here
  mk.loss = timer_->mark();
  ScopedRange rr(ranges_, "filter.rewrite");
  collider::FilterOptions fo;
  fo.attention = cfg_.spec.attention_grad;
  fo.check_every = cfg_.check_every;
  if (cfg_.spec.method == Method::kCollider) {
    r.filter = collider::filter_backward(f.loss, f.keep_BT, *plan_, fo);
  } else if (cfg_.spec.method == Method::kMasked) {
    r.filter = collider::mask_backward(f.loss, f.keep_BT, *plan_, fo);
  }
  return f;
}

void Trainer::allreduce_begin(const Filtered& f, int64_t tokens) {
  // Before backward: the per-rank loss and kept count are known, so the reducer can scale and
  // start gradient buckets while backward runs (overlap_backward).
  ScopedRange rg(ranges_, "allreduce.begin");
  reducer_->begin(f.loss.detach().item<double>(), f.keep_BT.sum().item<int64_t>(), tokens);
}

void Trainer::run_backward(const torch::Tensor& loss) {
  ScopedRange rg(ranges_, "bwd");
  if (layer_timer_) layer_timer_->backward_begin();
  loss.backward();
  if (layer_timer_) layer_timer_->backward_end();
}

void Trainer::allreduce_finish(StepResult& r) {
  ScopedRange rg(ranges_, "allreduce");
  r.dist = reducer_->finish();
}

void Trainer::run_optimizer(StepResult& r) {
  ScopedRange rg(ranges_, "optimizer");
  if (cfg_.grad_clip > 0) { r.grad_norm = torch::nn::utils::clip_grad_norm_(model_->parameters(), cfg_.grad_clip); }
  optimizer_->step();
}

void Trainer::write_times(const Marks& mk, StepResult& r) {
  r.fwd_ms = timer_->elapsed_ms(mk.start, mk.fwd);
  r.select_ms = timer_->elapsed_ms(mk.fwd, mk.select);
  r.rewrite_ms = timer_->elapsed_ms(mk.loss, mk.filter);
  r.filter_ms = timer_->elapsed_ms(mk.fwd, mk.filter);
  r.bwd_ms = timer_->elapsed_ms(mk.begin, mk.bwd);
  r.allreduce_ms = timer_->elapsed_ms(mk.filter, mk.begin) + timer_->elapsed_ms(mk.bwd, mk.reduce);
  r.optim_ms = timer_->elapsed_ms(mk.reduce, mk.opt);
  r.step_ms = timer_->elapsed_ms(mk.start, mk.opt);
  if (layer_timer_) r.layers = layer_timer_->resolve();
}

void Trainer::write_counts(const Batch& batch, const torch::Tensor& loss_BT, const Filtered& f, StepResult& r) const {
  r.loss = r.dist ? r.dist->loss : f.loss.detach().item<double>();
  r.loss_all = models::masked_mean_loss(loss_BT.detach(), batch.labels_BT != -100).item<double>();  // this rank's
  r.tokens = r.dist ? r.dist->tokens : batch.labels_BT.numel();
  r.tokens_kept = r.dist ? r.dist->tokens_kept : f.keep_BT.sum().item<int64_t>();
  auto per_row = f.keep_BT.sum(1).cpu();
  r.kept_per_row.assign(per_row.data_ptr<int64_t>(), per_row.data_ptr<int64_t>() + per_row.numel());
  const bool equal =
      std::all_of(r.kept_per_row.begin(), r.kept_per_row.end(), [&](int64_t n) { return n == r.kept_per_row[0]; });
  r.kept_per_seq = equal ? r.kept_per_row[0] : -1;
}

}  // namespace collider::harness
