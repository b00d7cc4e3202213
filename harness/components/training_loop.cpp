// The step loop of one training run (training_loop.h): schedule, progress, evaluation,
// checkpoints by renames, resume, data-parallel rules.
#include "harness/components/training_loop.h"

#include "base/duration.h"
#include "base/fault.h"
#include "base/fsutil.h"
#include "models/checkpoint.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <ostream>
#include <vector>

namespace collider::harness {

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

nlohmann::json RunState::to_json() const {
  return {{"step", step},
          {"elapsed_s", elapsed_s},
          {"tokens_seen", tokens_seen},
          {"tokens_backprop", tokens_backprop},
          {"log_loss_sum", log_loss_sum},
          {"log_kept_sum", log_kept_sum},
          {"log_steps", log_steps}};
}

RunState RunState::from_json(const nlohmann::json& j) {
  RunState s;
  s.step = j.at("step").get<int64_t>();
  s.elapsed_s = j.at("elapsed_s").get<double>();
  s.tokens_seen = j.at("tokens_seen").get<double>();
  s.tokens_backprop = j.at("tokens_backprop").get<double>();
  s.log_loss_sum = j.value("log_loss_sum", 0.0);  // absent in checkpoints of earlier versions
  s.log_kept_sum = j.value("log_kept_sum", 0.0);
  s.log_steps = j.value("log_steps", int64_t{0});
  return s;
}

int64_t from_rank0(ProcessGroup* pg, int64_t value, const char* what) {
  if (pg == nullptr) return value;
  std::vector<torch::Tensor> t = {torch::full({1}, value, torch::kInt64)};
  pg->broadcast(t, 0, what);
  return t[0].item<int64_t>();
}

std::string from_rank0(ProcessGroup* pg, const std::string& value, const char* what) {
  if (pg == nullptr) return value;
  const int64_t n = from_rank0(pg, static_cast<int64_t>(value.size()), what);
  auto bytes = torch::zeros({std::max<int64_t>(n, 1)}, torch::kUInt8);
  if (pg->rank() == 0) std::memcpy(bytes.data_ptr<uint8_t>(), value.data(), value.size());
  std::vector<torch::Tensor> t = {bytes};
  pg->broadcast(t, 0, what);
  return std::string(reinterpret_cast<const char*>(t[0].data_ptr<uint8_t>()), static_cast<size_t>(n));
}

namespace {

double lr_at(int64_t step, const RunSpec& r) {
  if (step < r.warmup_steps) return r.lr * static_cast<double>(step + 1) / static_cast<double>(r.warmup_steps);
  const double span = std::max<int64_t>(1, r.steps - r.warmup_steps);
  const double t = std::min(1.0, static_cast<double>(step - r.warmup_steps) / span);
  return r.min_lr + 0.5 * (r.lr - r.min_lr) * (1.0 + std::cos(M_PI * t));
}

// A checkpoint directory is complete when its trainer_state.json (written last) exists.
bool checkpoint_complete(const std::string& dir) { return fsutil::exists(fsutil::join(dir, "trainer_state.json")); }

// Checkpoints are replaced by renames only: the new one is written whole into DIR.tmp, the old
// one is moved to DIR.old, the new one renamed to DIR, and DIR.old removed. Whenever a process
// is killed, one complete checkpoint remains under one of these names; recover_checkpoint (at
// resume) puts it back at DIR. (Removing DIR in place could leave a half-deleted directory
// whose trainer_state.json still exists.)
void save_checkpoint(const std::string& dir, Trainer& tr, const RunState& st) {
  const std::string tmp = dir + ".tmp", old = dir + ".old";
  fsutil::remove_tree(tmp);
  models::save_training_checkpoint(tmp, tr.model(), models::adamw_state_tensors(tr.optimizer(), *tr.model()),
                                   st.to_json());
  if (fsutil::exists(dir)) {
    fsutil::remove_tree(old);
    fsutil::rename_path(dir, old);
  }
  fault::hit("checkpoint_swap");  // tests: killed between the two renames
  fsutil::rename_path(tmp, dir);
  fsutil::sync_directory(fsutil::parent_dir(dir));
  fsutil::remove_tree(old);
}

// After a kill: the newest complete checkpoint of DIR, DIR.tmp (written, not yet renamed in) and
// DIR.old (moved aside) goes back to DIR; the leftovers are removed.
void recover_checkpoint(const std::string& dir) {
  const std::string tmp = dir + ".tmp", old = dir + ".old";
  if (!checkpoint_complete(dir)) {
    // DIR is only ever created by renaming a complete checkpoint to it, so an incomplete DIR is a
    // leftover of an earlier version of this code: drop it.
    fsutil::remove_tree(dir);
    if (checkpoint_complete(tmp)) {
      fsutil::rename_path(tmp, dir);
    } else if (checkpoint_complete(old)) {
      fsutil::rename_path(old, dir);
    }
  }
  fsutil::remove_tree(tmp);
  fsutil::remove_tree(old);
}

}  // namespace

void remove_checkpoint(const std::string& dir) {
  const std::string done = dir + ".done";
  fsutil::remove_tree(done);
  if (fsutil::exists(dir)) fsutil::rename_path(dir, done);
  fsutil::remove_tree(done);
  fsutil::remove_tree(dir + ".tmp");
  fsutil::remove_tree(dir + ".old");
}

void train_loop(const TrainSettings& s, RunSpec spec, Trainer& tr,
                const std::function<void(const RunState&, double, double, double)>& on_log,
                const std::function<void(const RunState&, double)>& on_eval, std::ostream& log) {
  RunState st;
  // Rank 0 puts the newest complete checkpoint back in place after a kill; every rank then resumes
  // from it when rank 0 sees one.
  if (spec.resume && (spec.dist == nullptr || spec.dist->rank() == 0)) recover_checkpoint(spec.ckpt_dir);
  const bool have_ckpt =
      from_rank0(spec.dist, spec.resume && fsutil::exists(fsutil::join(spec.ckpt_dir, "trainer_state.json")),
                 "whether a checkpoint exists") != 0;
  if (have_ckpt) {
    auto ts = models::load_training_checkpoint(spec.ckpt_dir, tr.model());
    models::restore_adamw_state(tr.optimizer(), *tr.model(), ts.optimizer_state);
    st = RunState::from_json(ts.trainer_state);
    tr.set_draws(st.step);  // forward_drop: one subset per step, the ones of the steps not yet run
    log << fmt::format("{} resumed at step {} from {}\n", spec.label, st.step, spec.ckpt_dir);
  }
  // The checkpoint holds the sum over all ranks: rank 0 carries it on, the others start from 0.
  double loss_sum = spec.dist && spec.dist->rank() != 0 ? 0.0 : st.log_loss_sum, kept_sum = st.log_kept_sum;
  int64_t loss_n = st.log_steps;
  const int64_t first = st.step;
  const double elapsed_at_start = st.elapsed_s;
  while (st.step < spec.steps) {
    const auto t0 = Clock::now();
    const double lr = lr_at(st.step, spec);
    for (auto& g : tr.optimizer().param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
    const auto windows = spec.loader->window_ids(st.step);
    Batch b = spec.loader->batch_of(windows);
    if (spec.ref) b.ref_loss_BT = spec.ref->rows(windows);
    if (spec.may_stop && st.step == 2 && s.fail_rank == (spec.dist ? spec.dist->rank() : 0)) {
      throw std::runtime_error(fmt::format("train.fail_rank = {} (tests): this rank fails at step 2", s.fail_rank));
    }
    const StepResult r = tr.step(b);
    if (!std::isfinite(r.loss)) {
      throw std::runtime_error(fmt::format("{}: loss is {} at step {}", spec.label, r.loss, st.step));
    }
    st.step += 1;
    st.elapsed_s += seconds_since(t0);
    st.tokens_seen += static_cast<double>(r.tokens);
    st.tokens_backprop += static_cast<double>(r.tokens_kept);
    st.last_kept_per_row = r.kept_per_row;
    // r.loss (kept) and the token counts are over every rank already; loss_all is this rank's:
    // its share of the global mean, summed over ranks when logged.
    loss_sum += spec.dist ? r.loss_all * static_cast<double>(b.input_ids_BT.numel()) / static_cast<double>(r.tokens)
                          : r.loss_all;
    kept_sum += r.loss;
    loss_n += 1;
    const double per_step = (st.elapsed_s - elapsed_at_start) / static_cast<double>(st.step - first);
    if (st.step % s.log_every == 0 || st.step == spec.steps) {
      if (spec.dist) {
        std::vector<torch::Tensor> t = {torch::full({1}, loss_sum, torch::kFloat64)};
        spec.dist->all_reduce_sum(t, "the training loss over ranks");
        loss_sum = t[0].item<double>();
      }
      const double mean = loss_sum / static_cast<double>(loss_n), kept = kept_sum / static_cast<double>(loss_n);
      log << fmt::format("{} step {}/{} loss {:.4f} (kept {:.4f}) lr {:.2e} {:.2f} s/step elapsed {} ETA {}\n",
                         spec.label, st.step, spec.steps, mean, kept, lr, per_step, hms(st.elapsed_s),
                         hms(per_step * static_cast<double>(spec.steps - st.step)))
          << std::flush;
      on_log(st, mean, kept, lr);
      loss_sum = kept_sum = 0;
      loss_n = 0;
    }
    // Rank 0 evaluates (every replica holds the same parameters) while the others wait.
    if (st.step % s.eval_every == 0 || st.step == spec.steps) run_on_rank0(spec.dist, [&] { on_eval(st, lr); });
    if (st.step % s.checkpoint_every == 0 && st.step < spec.steps) {
      st.log_loss_sum = loss_sum;  // this rank's share: the checkpoint keeps the sum over ranks
      if (spec.dist) {
        std::vector<torch::Tensor> t = {torch::full({1}, loss_sum, torch::kFloat64)};
        spec.dist->all_reduce_sum(t, "the training loss over ranks (checkpoint)");
        st.log_loss_sum = t[0].item<double>();
      }
      st.log_kept_sum = kept_sum;
      st.log_steps = loss_n;
      run_on_rank0(spec.dist, [&] { save_checkpoint(spec.ckpt_dir, tr, st); });
      if (spec.may_stop && st.step == s.stop_after) { throw SimulatedKill(); }
    }
  }
}

}  // namespace collider::harness
