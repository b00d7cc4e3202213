// The measurement engine's group (group.h): one model and trainer for the points of a group,
// their warm-up and interleaved rounds, and their rows (identity, measured keys, work).
#include "harness/measure/group.h"

#include "measuring/rounds.h"
#include "measuring/stats.h"
#include "measuring/memory.h"
#include "harness/components/timer.h"
#include "harness/components/token_data.h"
#include "harness/components/train_step.h"
#include "harness/measure/failure.h"
#include "harness/measure/point_measurements.h"
#include "harness/measure/probes.h"
#include "harness/measure/table.h"
#include "harness/run/run_dir.h"
#include "models/flops.h"
#include "models/model.h"

#include <c10/core/CachingDeviceAllocator.h>
#include <fmt/format.h>

#include <algorithm>

namespace collider::harness {
namespace {

// forward_drop: the tokens per row its middle layers see (Trainer::middle_tokens: the kept count
// of the other methods, aligned to run.align), known before running; 0 for every other method.
int64_t middle_tokens_per_seq(const Manifest& m, const Point& p) {
  return p.spec.method == Method::kForwardDrop ? collider::kept_count(p.seq_len, p.filter_ratio, m.run.align) : 0;
}

// The point's row before it is measured: identity and provenance (results.h), its measured keys
// cleared, and what the manifest says of it.
nlohmann::json point_row(const Manifest& m, const Point& p, const Provenance& prov) {
  nlohmann::json row = identity_row({m.name, p.id(), p.model, p.seq_len, p.batch_size, p.filter_ratio, p.method,
                                     p.attention_grad, m.run.dtype, m.run.device},
                                    prov);
  clear_measurements(row);
  row["tokens"] = p.batch_size * p.seq_len;
  row["flops_fwd"] = nullptr;
  row["warmup_steps"] = m.run.warmup_steps;
  row["measure_steps"] = m.run.measure_steps;
  row["repetitions"] = m.run.repetitions;
  row["group"] = p.group_id();
  row["aa_copy"] = p.aa_copy;
  // A T' floor point (run.floor): the seq_len of the group it was measured in; null otherwise.
  row["floor_of"] = p.floor_of > 0 ? nlohmann::json(p.floor_of) : nlohmann::json(nullptr);
  row["seed"] = m.run.seed;
  row["selection"] = collider::to_string(p.spec.policy);
  row["score"] = to_string(p.spec.score);
  row["attention_impl"] = m.run.attention_impl;
  row["head"] = m.run.head;
  row["align"] = m.run.align;
  // forward_drop's middle-layer tokens per row (its flops_fwd and flops_bwd count them); null for
  // the methods whose layers see every token.
  const int64_t middle = middle_tokens_per_seq(m, p);
  row["middle_tokens_per_seq"] = middle > 0 ? nlohmann::json(middle) : nlohmann::json(nullptr);
  return row;
}

// The StepConfig of a point: its MethodSpec and ratio with the run's optimizer and timing settings.
StepConfig step_config(const Manifest& m, const Point& p) {
  StepConfig sc;
  sc.spec = p.spec;
  sc.filter_ratio = p.filter_ratio;
  sc.align = m.run.align;
  sc.lr = m.run.lr;
  sc.weight_decay = m.run.weight_decay;
  sc.beta1 = m.run.beta1;
  sc.beta2 = m.run.beta2;
  sc.eps = m.run.eps;
  sc.grad_clip = m.run.grad_clip;
  sc.bf16_autocast = m.run.dtype == "bf16";
  sc.layer_timing = m.run.layer_timing;
  sc.fused_head = m.run.head == "fused";
  sc.check_every = 0;  // a timing sweep measures the filtered step alone; the tests check the gradients
  return sc;
}

// The work of a point: analytic backward FLOPs for its method and kept counts, throughput, MFU.
void write_work(nlohmann::json& row, const Manifest& m, const models::ModelConfig& cfg, const Point& p,
                const PointMeasurements& acc, int world, double peak_flops) {
  // Collider's backward FLOPs on the actual kept counts, row by row (the FLOP ideal of ragged
  // rows, models/flops.h: backward_flops_rows). flops_bwd_executed stays in the rows for the
  // schema; it equals flops_bwd.
  const std::vector<int64_t>& kept_per_row = acc.kept_per_row();
  models::FlopCount bwd_flops{};
  if (p.spec.method == Method::kCollider && !kept_per_row.empty()) {
    bwd_flops = models::backward_flops_rows(cfg, p.seq_len, kept_per_row, p.spec);
  } else {
    // collider: the kept count; forward_drop: its middle layers' count; the dense methods ignore N.
    const int64_t N = p.spec.method == Method::kCollider      ? acc.kept_per_seq()
                      : p.spec.method == Method::kForwardDrop ? middle_tokens_per_seq(m, p)
                                                              : p.seq_len;
    bwd_flops = models::backward_flops(cfg, p.batch_size, p.seq_len, N, p.spec);
  }
  const auto bwd_dense = models::backward_flops(cfg, p.batch_size, p.seq_len, p.seq_len, MethodSpec{});  // regular
  row["flops_bwd"] = bwd_flops.total();
  row["flops_bwd_executed"] = bwd_flops.total();
  row["flops_bwd_dense"] = bwd_dense.total();
  row["flop_ideal_bwd_reduction"] = 1.0 - bwd_flops.total() / bwd_dense.total();
  const double step_s = acc.step_ms() / 1e3;
  // tokens, tokens_kept, FLOPs and tokens_per_s are this rank's (one device's); global_* all ranks'.
  row["tokens_per_s"] = step_s > 0 ? static_cast<double>(p.batch_size * p.seq_len) / step_s : 0.0;
  row["global_tokens"] = p.batch_size * p.seq_len * world;
  row["global_tokens_per_s"] = step_s > 0 ? static_cast<double>(p.batch_size * p.seq_len * world) / step_s : 0.0;
  row["device_peak_flops"] = peak_flops > 0 ? nlohmann::json(peak_flops) : nlohmann::json(nullptr);
  row["mfu"] = peak_flops > 0 && step_s > 0
                   ? nlohmann::json((row["flops_fwd"].get<double>() + bwd_flops.total()) / step_s / peak_flops)
                   : nlohmann::json(nullptr);
}

}  // namespace

double device_peak_flops(const std::string& device_name, const std::string& dtype) {
  if (dtype != "bf16") return 0.0;
  if (device_name.find("H100") != std::string::npos || device_name.find("H200") != std::string::npos) return 989e12;
  return 0.0;
}

namespace {

// One point of an interleaved group while the group is measured.
struct Member {
  const Point* point;
  nlohmann::json row;
  PointMeasurements acc;
  int64_t steps = 0;    // its steps so far, warm-up and measured (what the profiling window counts)
  int64_t wall_ns = 0;  // its own steps' wall time
  bool failed = false;
};

// One group while it is measured: its points (members), the model and trainer they share, and the
// failure policy. measure_group runs set_up(), measure() and rows() in that order.
class Group {
 public:
  Group(const Manifest& m, const std::vector<const Point*>& points, const Provenance& prov, RangeRecorder* ranges,
        int64_t profile_begin, int64_t profile_end, const std::shared_ptr<ProcessGroup>& dist, std::ostream* log,
        std::string label)
      : m_(m),
        prov_(prov),
        ranges_(ranges),
        profile_begin_(profile_begin),
        profile_end_(profile_end),
        dist_(dist),
        log_(log),
        label_(std::move(label)),
        world_(dist ? dist->world_size() : 1),
        rank_(dist ? dist->rank() : 0),
        // One device per rank on a machine: cuda:LOCAL_RANK.
        device_(m.run.device != "cuda" ? torch::Device(torch::kCPU)
                : dist ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(dist->env().local_rank))
                       : torch::Device(torch::kCUDA)),
        data_gen_(at::detail::createCPUGenerator(static_cast<uint64_t>(m.run.seed) * 7919 + 17)) {
    members_.reserve(points.size());
    for (const Point* p : points) {
      Member mb{p, point_row(m, *p, prov), PointMeasurements(rank_)};
      mb.row["world_size"] = world_;
      mb.row["global_batch_size"] = p->batch_size * world_;
      members_.push_back(std::move(mb));
    }
  }

  // The preset, the memory probe, the work known before running (and run.fail_point), then the
  // model and trainer of the group's first point.
  void set_up() {
    try {
      cfg_ = &models::preset(members_.front().point->model);
      if (!device_.is_cuda()) memory::install_cpu_memory_tracking();  // before the model's tensors exist
      probe_ = std::make_unique<memory::MemoryProbe>(device_);
    } catch (...) {
      for (auto& mb : members_) fail(mb, std::current_exception(), /*in_collectives=*/false);
    }
    for (auto& mb : members_) {
      if (mb.failed) continue;
      try {
        const Point& p = *mb.point;
        mb.row["flops_fwd"] =
            models::forward_flops(*cfg_, p.batch_size, p.seq_len, middle_tokens_per_seq(m_, p), p.spec).total();
        mb.row["attention_linear_ratio"] = models::attention_linear_ratio(*cfg_, p.seq_len);
        mb.row["num_params"] = cfg_->num_params();
        if (!m_.run.fail_point.empty() && p.id().find(m_.run.fail_point) != std::string::npos) {
          throw std::runtime_error("injected failure (run.fail_point = \"" + m_.run.fail_point + "\")");
        }
      } catch (...) { fail(mb, std::current_exception(), /*in_collectives=*/false); }
    }
    const bool any_left = std::any_of(members_.begin(), members_.end(), [](const Member& mb) { return !mb.failed; });
    if (!any_left || stopped()) return;
    try {
      const uint64_t seed = static_cast<uint64_t>(m_.run.seed);
      const auto attn = models::attention_impl_from_string(m_.run.attention_impl);
      trainer_ = std::make_unique<Trainer>(models::build_model(*cfg_, attn, seed),
                                           step_config(m_, *members_.front().point), device_, seed, ranges_);
      if (dist_) trainer_->set_reducer(std::make_shared<GradientReducer>(dist_, trainer_->model()->parameters()));
      if (!m_.run.data.empty()) text_ = group_text_batch();
      for (auto& mb : members_) {
        mb.acc.set_timer_kind(trainer_->timer().kind());
        if (trainer_->reducer()) mb.acc.set_overlaps(trainer_->reducer()->overlaps_backward());
      }
    } catch (...) {
      for (auto& mb : members_)
        if (!mb.failed) fail(mb, std::current_exception(), /*in_collectives=*/true);
    }
  }

  // Every standing point's warm-up, then the interleaved rounds, a progress line after each.
  void measure() {
    if (!trainer_) return;
    stats::Interleaving how;
    how.warm_up = [&](size_t j) { guarded_block(members_[j], -1); };
    how.measure = [&](size_t j, int64_t rep) { guarded_block(members_[j], rep); };
    how.standing = [&](size_t j) { return !members_[j].failed; };
    how.stop = [&] { return stopped(); };
    how.after_round = [&](int64_t rep) { progress_line(rep); };
    stats::interleave(members_.size(), m_.run.repetitions, how);
    if (profiling_) cuda_profiler_stop();
  }

  // The rows, in the order given: measured keys and work, or the failure with no partial timings.
  GroupRows rows() {
    for (auto& mb : members_) {
      if (!mb.failed && stopped()) {
        mb.row["status"] = "error";
        mb.row["error"] = fmt::format(
            "not measured to the end: point {} of the same interleaved group failed first, and a data-parallel run "
            "stops at the first failing point",
            members_[static_cast<size_t>(out_.first_failed)].point->id());
        mb.failed = true;
      }
      if (!mb.failed) {
        mb.acc.write(mb.row, dist_.get(), probe_->method());
        write_work(mb.row, m_, *cfg_, *mb.point, mb.acc, world_, device_peak_flops(prov_.device_name, m_.run.dtype));
      } else {
        clear_measurements(mb.row);
      }
      mb.row["group_points"] = static_cast<int64_t>(members_.size());
      mb.row["point_wall_s"] = static_cast<double>(mb.wall_ns) * 1e-9;
      mb.row["timestamp"] = utc_timestamp();
      out_.rows.push_back(std::move(mb.row));
    }
    write_group_figures(out_.rows);  // against the group's regular, FLOP ideal and floors (measuring/figures.h)
    return std::move(out_);
  }

 private:
  // A data-parallel run ends after the group of its first failing point. A failure before any
  // collective (the point's own checks, the same on every rank) lets the group's other points
  // run; one during set-up or a step stops the group at once, since the other ranks may wait
  // in that point's collectives.
  void fail(Member& mb, const std::exception_ptr& e, bool in_collectives) {
    record_failure(mb.row, e);
    mb.failed = true;
    if (dist_ && out_.first_failed < 0) out_.first_failed = static_cast<int>(&mb - members_.data());
    if (in_collectives) stop_now_ = true;
  }
  bool stopped() const { return dist_ && stop_now_; }

  // measure_steps (or warm-up) steps of one point; `rep` < 0 for its warm-up.
  void run_block(Member& mb, int64_t rep) {
    const bool measured = rep >= 0;
    const int64_t n = measured ? m_.run.measure_steps : m_.run.warmup_steps;
    if (n == 0) return;
    const Point& p = *mb.point;
    ScopedRange block_range(ranges_, (measured ? "point " : "warm-up ") + p.id());
    trainer_->set_method(p.spec, p.filter_ratio);
    if (device_.is_cuda()) torch::cuda::synchronize();
    const int64_t t0 = host_now_ns();
    if (measured) {
      probe_->reset_peak();
      mb.acc.begin_measured();
    }
    for (int64_t s = 0; s < n; ++s, ++mb.steps) {
      if (mb.steps == profile_begin_ && !profiling_) {
        cuda_profiler_start();
        profiling_ = true;
      }
      // Every rank draws the same global batch and takes its own rows (world 1: the whole batch).
      Batch batch = text_ ? text_at(p.seq_len)
                          : random_batch(p.batch_size * world_, p.seq_len, cfg_->vocab_size, data_gen_, device_);
      if (world_ > 1) {
        batch.input_ids_BT = batch.input_ids_BT.narrow(0, rank_ * p.batch_size, p.batch_size);
        batch.labels_BT = batch.labels_BT.narrow(0, rank_ * p.batch_size, p.batch_size);
        if (batch.ref_loss_BT) batch.ref_loss_BT = batch.ref_loss_BT->narrow(0, rank_ * p.batch_size, p.batch_size);
      }
      StepResult r;
      {
        ScopedRange sr(ranges_, measured ? fmt::format("measure.{:03d}", rep * m_.run.measure_steps + s)
                                         : fmt::format("warmup.{:03d}", s));
        r = trainer_->step(batch);
      }
      if (mb.steps + 1 == profile_end_ && profiling_) {
        cuda_profiler_stop();
        profiling_ = false;
      }
      mb.acc.add_step(r, measured);
    }
    if (device_.is_cuda()) torch::cuda::synchronize();
    if (measured) mb.acc.end_repetition(probe_->peak_bytes());
    // run.copy_probe: a plain cold copy of the bytes this point's rewrite cut, after its steps.
    if (measured && m_.run.copy_probe && p.spec.method == Method::kCollider)
      mb.acc.add_copy_probe(cold_copy_ms(mb.acc.bytes_gathered(), device_));
    mb.wall_ns += host_now_ns() - t0;
  }

  // run.data: the group's batch of real text at its T (every step of every point runs on it).
  Batch group_text_batch() const {
    const Point& p = *members_.front().point;
    Batch b = text_batch(m_.run.data, m_.run.reference_losses, p.batch_size * world_,
                         p.floor_of > 0 ? p.floor_of : p.seq_len, cfg_->vocab_size);
    b.input_ids_BT = b.input_ids_BT.to(device_);
    b.labels_BT = b.labels_BT.to(device_);
    return b;
  }
  // Its first T positions: a floor point's T' (regular at T' runs on the same text).
  Batch text_at(int64_t T) const {
    if (T == text_->input_ids_BT.size(1)) return *text_;
    return Batch{text_->input_ids_BT.narrow(1, 0, T), text_->labels_BT.narrow(1, 0, T),
                 text_->ref_loss_BT->narrow(1, 0, T)};
  }

  // interleave() runs a block only for a point still standing in a group not stopped.
  void guarded_block(Member& mb, int64_t rep) {
    try {
      run_block(mb, rep);
    } catch (...) {
      fail(mb, std::current_exception(), /*in_collectives=*/true);
      if (device_.is_cuda() && mb.row["status"] == "oom") c10::getDeviceAllocator(c10::DeviceType::CUDA)->emptyCache();
    }
  }

  // "  <label> round r/R: step ms <point> <ms>, ..." in manifest order, whatever the round's order.
  void progress_line(int64_t rep) const {
    if (!log_ || (dist_ && dist_->rank() != 0) || m_.run.repetitions <= 1) return;
    std::string line;
    for (const auto& mb : members_) {
      const Point& p = *mb.point;
      line += fmt::format("{}{} {}", line.empty() ? "" : ", ",
                          point_label(p.method, p.attention_grad, p.ragged(), p.filter_ratio, p.aa_copy,
                                      p.floor_of > 0 ? p.seq_len : 0),
                          mb.failed ? std::string("failed") : fmt::format("{:.2f}", mb.acc.last_repetition_step_ms()));
    }
    *log_ << fmt::format("  {} round {}/{}: step ms {}\n", label_, rep + 1, m_.run.repetitions, line);
    log_->flush();
  }

  const Manifest& m_;
  const Provenance& prov_;
  RangeRecorder* ranges_;
  const int64_t profile_begin_, profile_end_;
  const std::shared_ptr<ProcessGroup>& dist_;
  std::ostream* log_;
  const std::string label_;
  const int world_, rank_;
  const torch::Device device_;
  torch::Generator data_gen_;
  std::optional<Batch> text_;  // run.data: the group's real text (else a random batch per step)
  std::vector<Member> members_;
  GroupRows out_;
  bool stop_now_ = false;
  bool profiling_ = false;
  const models::ModelConfig* cfg_ = nullptr;
  std::unique_ptr<memory::MemoryProbe> probe_;
  std::unique_ptr<Trainer> trainer_;
};

}  // namespace

GroupRows measure_group(const Manifest& m, const std::vector<const Point*>& points, const Provenance& prov,
                        RangeRecorder* ranges, int64_t profile_begin, int64_t profile_end,
                        const std::shared_ptr<ProcessGroup>& dist, std::ostream* log, const std::string& group_label) {
  ScopedRange group_range(ranges, "group " + group_label);
  Group group(m, points, prov, ranges, profile_begin, profile_end, dist, log, group_label);
  group.set_up();
  group.measure();
  return group.rows();
}

nlohmann::json measure_point(const Manifest& m, const Point& p, const Provenance& prov, RangeRecorder* ranges,
                             int64_t profile_begin, int64_t profile_end, const std::shared_ptr<ProcessGroup>& dist) {
  return measure_group(m, {&p}, prov, ranges, profile_begin, profile_end, dist, nullptr, p.group_id()).rows.at(0);
}

}  // namespace collider::harness
