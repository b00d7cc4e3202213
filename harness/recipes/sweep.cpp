// Sweep runner and per-point measurement (sweep.h): a point's StepConfig comes from its
// MethodSpec and the run settings (step_config), the step loop feeds PointMeasurements, and the
// row's measured keys are written from it (timings, layers, kept counts) and from the analytic
// FLOPs of the method and the kept counts (write_work; forward_drop: its middle-layer count). A
// failed point's measured keys are cleared (results.h: clear_measurements).
#include "harness/recipes/sweep.h"

#include "base/duration.h"
#include "base/fsutil.h"
#include "base/stats.h"
#include "harness/components/memory.h"
#include "harness/run/run_dir.h"
#include "harness/components/timer.h"
#include "harness/components/train_step.h"
#include "models/flops.h"
#include "models/model.h"

#include <c10/core/CachingDeviceAllocator.h>
#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <iostream>
#include <map>

#include <time.h>

namespace collider::harness {
namespace {

int64_t process_cpu_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

using stats::median;
using stats::rel_iqr;

bool looks_like_oom(const std::string& msg) {
  return msg.find("out of memory") != std::string::npos || msg.find("not enough memory") != std::string::npos ||
         msg.find("can't allocate memory") != std::string::npos;
}

// forward_drop: the tokens per row its middle layers see (Trainer::middle_tokens: the kept count
// of the other methods, aligned to run.align), known before running; 0 for every other method.
int64_t middle_tokens_per_seq(const Manifest& m, const Point& p) {
  return p.spec.method == Method::kForwardDrop ? collider::kept_count(p.seq_len, p.filter_ratio, m.run.align) : 0;
}

nlohmann::json identity_row(const Manifest& m, const Point& p, const Provenance& prov) {
  nlohmann::json row = {
      {"experiment", m.name},
      {"point_id", p.id()},
      {"status", "ok"},
      {"error", nullptr},
      {"model", p.model},
      {"seq_len", p.seq_len},
      {"batch_size", p.batch_size},
      {"filter_ratio", p.filter_ratio},
      {"method", p.method},
      {"attention_grad", p.attention_grad},
      {"dtype", m.run.dtype},
      {"device", m.run.device},
  };
  clear_measurements(row);
  row["tokens"] = p.batch_size * p.seq_len;
  row["flops_fwd"] = nullptr;
  const nlohmann::json prov_json = to_json(prov);
  for (auto it = prov_json.begin(); it != prov_json.end(); ++it) row[it.key()] = it.value();
  row["warmup_steps"] = m.run.warmup_steps;
  row["measure_steps"] = m.run.measure_steps;
  row["repetitions"] = m.run.repetitions;
  row["group"] = p.group_id();
  row["aa_copy"] = p.aa_copy;
  row["seed"] = m.run.seed;
  row["selection"] = collider::to_string(p.spec.policy);
  row["score"] = to_string(p.spec.score);
  row["attention_impl"] = m.run.attention_impl;
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
  return sc;
}

// What the steps of one point add up to: the step loop feeds it every step (warm-up steps only
// count for the losses), and the row's measured keys are written from it.
class PointMeasurements {
 public:
  explicit PointMeasurements(int rank) : rank_(rank) {}

  // Before the first measured step of a repetition.
  void begin_measured() {
    cpu_ns_begin_ = process_cpu_ns();
    rep_begin_ = step_.size();
  }

  void add_step(const StepResult& r, bool measured) {
    losses_.push_back(r.loss);
    if (!measured) return;
    fwd_.push_back(r.fwd_ms);
    bwd_.push_back(r.bwd_ms);
    filter_.push_back(r.filter_ms);
    select_.push_back(r.select_ms);
    rewrite_.push_back(r.rewrite_ms);
    optim_.push_back(r.optim_ms);
    step_.push_back(r.step_ms);
    allreduce_.push_back(r.allreduce_ms);
    tokens_kept_ = r.dist ? r.dist->rank_tokens_kept[rank_] : r.tokens_kept;
    global_tokens_kept_ = r.tokens_kept;
    if (r.dist) {
      ar_wait_.push_back(r.dist->wait_ms);
      ar_bucket_.push_back(r.dist->bucket_ms);
      allreduce_bytes_ = r.dist->bytes;
      allreduce_buckets_ = r.dist->num_buckets;
      buckets_overlapped_ = r.dist->buckets_overlapped;
      rank_tokens_kept_ = r.dist->rank_tokens_kept;
      rank_loss_ = r.dist->rank_loss;
    }
    kept_per_seq_ = r.kept_per_seq;
    kept_per_row_ = r.kept_per_row;
    filter_stats_ = r.filter;
    double step_layers_bwd = 0.0;
    for (const auto& l : r.layers) step_layers_bwd += l.bwd_ms;
    if (!r.layers.empty() && r.bwd_ms > 0) bwd_coverage_.push_back(step_layers_bwd / r.bwd_ms);
    for (const auto& l : r.layers) {
      if (!layer_fwd_.count(l.name)) layer_names_.push_back(l.name);
      layer_fwd_[l.name].push_back(l.fwd_ms);
      layer_bwd_[l.name].push_back(l.bwd_ms);
    }
  }

  // After the last step of a repetition (device synchronised): its peak memory and CPU time.
  void end_repetition(int64_t peak_bytes) {
    measured_cpu_ns_ += process_cpu_ns() - cpu_ns_begin_;
    peak_ = std::max(peak_, peak_bytes);
    // This repetition's steps are the samples since begin_measured.
    auto since_begin = [&](const std::vector<double>& v) {
      return median(std::vector<double>(v.begin() + static_cast<std::ptrdiff_t>(rep_begin_), v.end()));
    };
    rep_step_medians_.push_back(since_begin(step_));
    rep_fwd_medians_.push_back(since_begin(fwd_));
    rep_bwd_medians_.push_back(since_begin(bwd_));
  }

  void set_timer_kind(std::string kind) { timer_kind_ = std::move(kind); }
  void set_overlaps(bool overlaps) { overlaps_ = overlaps; }

  double step_ms() const { return median(step_); }
  double last_repetition_step_ms() const { return rep_step_medians_.empty() ? 0.0 : rep_step_medians_.back(); }
  int64_t kept_per_seq() const { return kept_per_seq_; }
  const std::vector<int64_t>& kept_per_row() const { return kept_per_row_; }  // this rank's, last measured step

  // Timings, per-layer medians, kept counts, memory, losses, rewrite statistics.
  void write(nlohmann::json& row, const ProcessGroup* dist, const std::string& peak_mem_method) const {
    row["fwd_ms"] = median(fwd_);
    row["bwd_ms"] = median(bwd_);
    row["filter_ms"] = median(filter_);
    row["optim_ms"] = median(optim_);
    row["step_ms"] = median(step_);
    row["select_ms"] = median(select_);
    row["rewrite_ms"] = median(rewrite_);
    row["allreduce_ms"] = median(allreduce_);  // 0 in single-process runs
    if (dist) {
      row["samples_allreduce_ms"] = allreduce_;
      // allreduce_ms = the wait for the slowest rank (a tiny all-reduce before backward) + the bucket
      // all-reduces still running after backward (all of them with COLLIDER_DIST_OVERLAP=0).
      row["allreduce_wait_ms"] = median(ar_wait_);
      row["allreduce_bucket_ms"] = median(ar_bucket_);
      row["allreduce_bytes"] = allreduce_bytes_;  // gradient bytes per rank per step
      row["allreduce_overlap"] = overlaps_;       // bucket all-reduces started during backward
      row["allreduce_buckets"] = allreduce_buckets_;
      row["allreduce_buckets_overlapped"] = buckets_overlapped_;
      row["distributed_backend"] = dist->backend();
      row["rank_tokens_kept"] = rank_tokens_kept_;  // last measured step, per rank
      row["rank_loss_last"] = rank_loss_;
    }
    row["samples_step_ms"] = step_;
    row["samples_fwd_ms"] = fwd_;
    row["samples_bwd_ms"] = bwd_;
    // The spread, as nvbench reports it: (q75 - q25) / median over every measured step of every
    // repetition; and each interleaved repetition's median (the tables pair them across methods).
    row["step_ms_rel_iqr"] = rel_iqr(step_);
    row["fwd_ms_rel_iqr"] = rel_iqr(fwd_);
    row["bwd_ms_rel_iqr"] = rel_iqr(bwd_);
    row["repetition_step_ms"] = rep_step_medians_;
    row["repetition_fwd_ms"] = rep_fwd_medians_;
    row["repetition_bwd_ms"] = rep_bwd_medians_;
    row["timer"] = timer_kind_;
    // CPU time this process used per measured step (all its threads): on a shared machine,
    // wall time well above it (times the threads) means the process waited for a core.
    row["process_cpu_ms_per_step"] =
        static_cast<double>(measured_cpu_ns_) * 1e-6 / static_cast<double>(std::max<size_t>(1, step_.size()));
    double layers_fwd_sum = 0, layers_bwd_sum = 0;
    nlohmann::json layers = nlohmann::json::array();
    for (const auto& name : layer_names_) {
      const double f = median(layer_fwd_.at(name)), b = median(layer_bwd_.at(name));
      layers_fwd_sum += f;
      layers_bwd_sum += b;
      layers.push_back({{"name", name}, {"fwd_ms", f}, {"bwd_ms", b}});
    }
    row["layers"] = layers;
    if (!layer_names_.empty()) {
      // How much of the backward the per-layer segments account for (1.0 = all of bwd_ms).
      row["layers_fwd_sum_ms"] = layers_fwd_sum;
      row["layers_bwd_sum_ms"] = layers_bwd_sum;
      // Per step: the sum of the per-layer backward times over bwd_ms; the row keeps the median.
      row["layers_bwd_coverage"] = median(bwd_coverage_);
    }
    row["tokens_kept"] = tokens_kept_;
    row["kept_per_seq"] = kept_per_seq_;
    // Kept counts of the rows (they differ under batch_topk), last measured step, this rank.
    if (!kept_per_row_.empty()) row["kept_per_row"] = kept_per_row_;
    write_kept_counts(row, kept_per_row_);
    row["global_tokens_kept"] = global_tokens_kept_;
    row["peak_mem_bytes"] = peak_;
    row["peak_mem_method"] = peak_mem_method;
    row["loss_first"] = losses_.empty() ? 0.0 : losses_.front();
    row["loss_last"] = losses_.empty() ? 0.0 : losses_.back();
    const collider::FilterStats& fs = filter_stats_;
    row["filter_stats"] = {{"nodes_visited", fs.nodes_visited},
                           {"nodes_rewritten", fs.nodes_rewritten},
                           {"tensors_gathered", fs.tensors_gathered},
                           {"bytes_before", fs.bytes_before},
                           {"bytes_gathered", fs.bytes_gathered},
                           {"kept", fs.kept},
                           {"kept_total", fs.kept_total},
                           {"gather_nodes_inserted", fs.gather_nodes_inserted},
                           {"gemms_packed", fs.gemms_packed},
                           {"rewrite_ms", fs.rewrite_ms},
                           {"gather_ms", fs.gather_ms}};
  }

 private:
  int rank_;
  std::vector<double> fwd_, bwd_, filter_, select_, rewrite_, optim_, step_, losses_, allreduce_, ar_wait_, ar_bucket_;
  std::vector<double> rep_step_medians_, rep_fwd_medians_, rep_bwd_medians_;
  size_t rep_begin_ = 0;  // index in step_ / fwd_ / bwd_ of the current repetition's first step
  std::vector<double> bwd_coverage_;
  std::map<std::string, std::vector<double>> layer_fwd_, layer_bwd_;
  std::vector<std::string> layer_names_;  // model order
  int64_t peak_ = -1, tokens_kept_ = -1, kept_per_seq_ = -1, global_tokens_kept_ = -1;
  int64_t allreduce_bytes_ = 0, allreduce_buckets_ = 0, buckets_overlapped_ = 0;
  bool overlaps_ = false;
  std::vector<int64_t> rank_tokens_kept_, kept_per_row_;
  std::vector<double> rank_loss_;
  collider::FilterStats filter_stats_;
  std::string timer_kind_;
  int64_t cpu_ns_begin_ = 0, measured_cpu_ns_ = 0;  // process CPU time (all threads) over measured steps
};

// The work of a point: analytic backward FLOPs for its method and kept counts, throughput, MFU.
void write_work(nlohmann::json& row, const Manifest& m, const models::ModelConfig& cfg, const Point& p,
                const PointMeasurements& acc, int world, double peak_flops) {
  // Collider's backward FLOPs on the actual kept counts, row by row (the FLOP ideal of ragged
  // rows). Ragged rows execute just that: the token-row GEMMs run on the packed kept rows and the
  // attention cores row by row (collider_core/src/row_attention.h; a core whose ops the stand-in
  // cannot replay would run padded, none of this suite's models has one). flops_bwd_executed
  // stays in the rows for the schema; it equals flops_bwd.
  const std::vector<int64_t>& kept_per_row = acc.kept_per_row();
  models::FlopCount bwd_flops{};
  if (p.spec.method == Method::kCollider && !kept_per_row.empty()) {
    for (int64_t n : kept_per_row) {
      if (n == 0) continue;  // a row that keeps nothing has no backward
      const auto f = models::backward_flops(cfg, 1, p.seq_len, n, p.spec);
      bwd_flops.linear += f.linear;
      bwd_flops.attention += f.attention;
      bwd_flops.lm_head += f.lm_head;
    }
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

// The status and message of a failed point from the exception `e` (a DistributedError is not a
// point's failure: it passes through and ends the run).
void record_failure(nlohmann::json& row, const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const DistributedError&) {
    throw;  // a peer died or hung: the run ends (cli.cpp prints it), no row
  } catch (const c10::OutOfMemoryError& e) {
    row["status"] = "oom";
    row["error"] = e.what_without_backtrace();
  } catch (const std::bad_alloc& e) {
    row["status"] = "oom";
    row["error"] = std::string("std::bad_alloc: ") + e.what();
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    row["status"] = looks_like_oom(msg) ? "oom" : "error";
    row["error"] = msg;
  } catch (const std::exception& e) {
    const std::string msg = e.what();
    row["status"] = looks_like_oom(msg) ? "oom" : "error";
    row["error"] = msg;
  }
}

// One point of an interleaved group while the group is measured.
struct Member {
  const Point* point;
  nlohmann::json row;
  PointMeasurements acc;
  int64_t steps = 0;    // its steps so far, warm-up and measured (what the profiling window counts)
  int64_t wall_ns = 0;  // its own steps' wall time
  bool failed = false;
};

// The short name of a point in a round's progress line: method[/attention_grad][/aa].
std::string short_name(const Point& p) {
  std::string s = p.method;
  if (models::uses_attention_grad(p.spec.method)) s += "/" + p.attention_grad;
  if (p.filter_ratio > 0 && p.spec.method != Method::kRegular) s += fmt::format("@{:g}", p.filter_ratio);
  if (p.aa_copy) s += "/aa";
  return s;
}

struct GroupRows {
  std::vector<nlohmann::json> rows;  // one per point, in the order given
  int first_failed = -1;             // data-parallel runs: the first failing point (the run ends here)
};

// Measures the points of one group (same model, seq_len and batch_size): one model, one trainer
// (Trainer::set_method switches between the points), one warm-up of warmup_steps per point, then
// `repetitions` rounds in which every point takes measure_steps steps in turn, in serpentine order
// (forward, then reversed, ...). Drift on a shared machine then hits every point of the group alike,
// and each round pairs the points' medians.
// A point that fails is left out of later rounds (its row keeps the failure); in a data-parallel
// run a failure during set-up or a step stops the group, since the other ranks may wait in its
// collectives, and the run ends after the group of its first failing point.
GroupRows measure_group(const Manifest& m, const std::vector<const Point*>& points, const Provenance& prov,
                        RangeRecorder* ranges, int64_t profile_begin, int64_t profile_end,
                        const std::shared_ptr<ProcessGroup>& dist, std::ostream* log, const std::string& group_label) {
  const int world = dist ? dist->world_size() : 1, rank = dist ? dist->rank() : 0;
  // One device per rank on a machine: cuda:LOCAL_RANK.
  const torch::Device device = m.run.device != "cuda" ? torch::Device(torch::kCPU)
                               : dist
                                   ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(dist->env().local_rank))
                                   : torch::Device(torch::kCUDA);
  std::vector<Member> members;
  members.reserve(points.size());
  for (const Point* p : points) {
    Member mb{p, identity_row(m, *p, prov), PointMeasurements(rank)};
    mb.row["world_size"] = world;
    mb.row["global_batch_size"] = p->batch_size * world;
    members.push_back(std::move(mb));
  }
  GroupRows out;
  // A data-parallel run ends after the group of its first failing point. A failure before any
  // collective (the point's own checks, the same on every rank) lets the group's other points
  // run; one during set-up or a step stops the group at once, since the other ranks may wait
  // in that point's collectives.
  bool stop_now = false;
  auto fail = [&](Member& mb, const std::exception_ptr& e, bool in_collectives) {
    record_failure(mb.row, e);
    mb.failed = true;
    if (dist && out.first_failed < 0) out.first_failed = static_cast<int>(&mb - members.data());
    if (in_collectives) stop_now = true;
  };
  auto stopped = [&] { return dist && stop_now; };
  ScopedRange group_range(ranges, "group " + group_label);

  const Point& first = *points.front();
  std::unique_ptr<Trainer> trainer;
  std::unique_ptr<MemoryProbe> probe;
  const models::ModelConfig* cfg = nullptr;
  try {
    cfg = &models::preset(first.model);
    if (!device.is_cuda()) install_cpu_memory_tracking();  // before the model's tensors exist
    probe = std::make_unique<MemoryProbe>(device);
  } catch (...) {
    for (auto& mb : members) fail(mb, std::current_exception(), /*in_collectives=*/false);
  }
  for (auto& mb : members) {
    if (mb.failed) continue;
    try {
      // Work known before running: forward FLOPs, attention/linear ratio.
      const Point& p = *mb.point;
      mb.row["flops_fwd"] =
          models::forward_flops(*cfg, p.batch_size, p.seq_len, middle_tokens_per_seq(m, p), p.spec).total();
      mb.row["attention_linear_ratio"] = models::attention_linear_ratio(*cfg, p.seq_len);
      mb.row["num_params"] = cfg->num_params();
      if (!m.run.fail_point.empty() && p.id().find(m.run.fail_point) != std::string::npos) {
        throw std::runtime_error("injected failure (run.fail_point = \"" + m.run.fail_point + "\")");
      }
    } catch (...) { fail(mb, std::current_exception(), /*in_collectives=*/false); }
  }
  const uint64_t seed = static_cast<uint64_t>(m.run.seed);
  torch::Generator data_gen = at::detail::createCPUGenerator(seed * 7919 + 17);
  const bool any_left = std::any_of(members.begin(), members.end(), [](const Member& mb) { return !mb.failed; });
  if (any_left && !stopped()) {
    try {
      const auto attn = m.run.attention_impl == "sdpa" ? models::AttentionImpl::kSdpa : models::AttentionImpl::kEager;
      trainer =
          std::make_unique<Trainer>(models::build_model(*cfg, attn, seed), step_config(m, first), device, seed, ranges);
      if (dist) trainer->set_reducer(std::make_shared<GradientReducer>(dist, trainer->model()->parameters()));
      for (auto& mb : members) {
        mb.acc.set_timer_kind(trainer->timer().kind());
        if (trainer->reducer()) mb.acc.set_overlaps(trainer->reducer()->overlaps_backward());
      }
    } catch (...) {
      for (auto& mb : members)
        if (!mb.failed) fail(mb, std::current_exception(), /*in_collectives=*/true);
    }
  }
  bool profiling = false;
  // measure_steps (or warm-up) steps of one point; `rep` < 0 for its warm-up.
  auto run_block = [&](Member& mb, int64_t rep) {
    const bool measured = rep >= 0;
    const int64_t n = measured ? m.run.measure_steps : m.run.warmup_steps;
    if (n == 0) return;
    const Point& p = *mb.point;
    ScopedRange block_range(ranges, (measured ? "point " : "warm-up ") + p.id());
    trainer->set_method(p.spec, p.filter_ratio);
    if (device.is_cuda()) torch::cuda::synchronize();
    const int64_t t0 = host_now_ns();
    if (measured) {
      probe->reset_peak();
      mb.acc.begin_measured();
    }
    for (int64_t s = 0; s < n; ++s, ++mb.steps) {
      if (mb.steps == profile_begin && !profiling) {
        cuda_profiler_start();
        profiling = true;
      }
      // Every rank draws the same global batch and takes its own rows (world 1: the whole batch).
      Batch batch = random_batch(p.batch_size * world, p.seq_len, cfg->vocab_size, data_gen, device);
      if (world > 1) {
        batch.input_ids_BT = batch.input_ids_BT.narrow(0, rank * p.batch_size, p.batch_size);
        batch.labels_BT = batch.labels_BT.narrow(0, rank * p.batch_size, p.batch_size);
      }
      StepResult r;
      {
        ScopedRange sr(ranges, measured ? fmt::format("measure.{:03d}", rep * m.run.measure_steps + s)
                                        : fmt::format("warmup.{:03d}", s));
        r = trainer->step(batch);
      }
      if (mb.steps + 1 == profile_end && profiling) {
        cuda_profiler_stop();
        profiling = false;
      }
      mb.acc.add_step(r, measured);
    }
    if (device.is_cuda()) torch::cuda::synchronize();
    if (measured) mb.acc.end_repetition(probe->peak_bytes());
    mb.wall_ns += host_now_ns() - t0;
  };
  auto guarded_block = [&](Member& mb, int64_t rep) {
    if (mb.failed || stopped()) return;
    try {
      run_block(mb, rep);
    } catch (...) {
      fail(mb, std::current_exception(), /*in_collectives=*/true);
      if (device.is_cuda() && mb.row["status"] == "oom") c10::getDeviceAllocator(c10::DeviceType::CUDA)->emptyCache();
    }
  };
  if (trainer) {
    for (auto& mb : members) guarded_block(mb, -1);
    for (int64_t rep = 0; rep < m.run.repetitions && !stopped(); ++rep) {
      // Serpentine order (base/stats.h): odd rounds run the points in reverse.
      for (size_t j = 0; j < members.size(); ++j) guarded_block(members[stats::serpentine(rep, j, members.size())], rep);
      std::string line;  // in manifest order, whatever the round's order was
      for (auto& mb : members) {
        line +=
            fmt::format("{}{} {}", line.empty() ? "" : ", ", short_name(*mb.point),
                        mb.failed ? std::string("failed") : fmt::format("{:.2f}", mb.acc.last_repetition_step_ms()));
      }
      if (log && (!dist || dist->rank() == 0) && m.run.repetitions > 1) {
        *log << fmt::format("  {} round {}/{}: step ms {}\n", group_label, rep + 1, m.run.repetitions, line);
        log->flush();
      }
    }
  }
  if (profiling) cuda_profiler_stop();

  for (auto& mb : members) {
    if (!mb.failed && stopped()) {
      mb.row["status"] = "error";
      mb.row["error"] = fmt::format(
          "not measured to the end: point {} of the same interleaved group failed first, and a data-parallel run "
          "stops at the first failing point",
          members[static_cast<size_t>(out.first_failed)].point->id());
      mb.failed = true;
    }
    if (!mb.failed) {
      mb.acc.write(mb.row, dist.get(), probe->method());
      write_work(mb.row, m, *cfg, *mb.point, mb.acc, world, device_peak_flops(prov.device_name, m.run.dtype));
    } else {
      clear_measurements(mb.row);  // a failed point leaves no partial timings behind
    }
    mb.row["group_points"] = static_cast<int64_t>(members.size());
    mb.row["point_wall_s"] = static_cast<double>(mb.wall_ns) * 1e-9;
    mb.row["timestamp"] = utc_timestamp();
    out.rows.push_back(std::move(mb.row));
  }
  return out;
}

}  // namespace

nlohmann::json measure_point(const Manifest& m, const Point& p, const Provenance& prov, RangeRecorder* ranges,
                             int64_t profile_begin, int64_t profile_end, const std::shared_ptr<ProcessGroup>& dist) {
  return measure_group(m, {&p}, prov, ranges, profile_begin, profile_end, dist, nullptr, p.group_id()).rows.at(0);
}

SweepSummary run_sweep(const Manifest& m, const SweepOptions& opts) {
  std::ostream& log = opts.log ? *opts.log : std::cerr;
  SweepSummary sum;
  sum.points = static_cast<int64_t>(m.points.size());
  if (opts.out_dir.empty()) throw std::runtime_error("run_sweep: no output directory given");
  ProcessGroup* dist = opts.dist.get();
  const bool writer = dist == nullptr || dist->rank() == 0;  // only rank 0 touches files
  const RunDir run_dir(opts.out_dir, opts.resume, writer, log);
  const std::string& results_path = run_dir.results_path();
  sum.results_path = results_path;
  const ExistingResults& existing = run_dir.existing();
  // Which points to skip (--resume) is rank 0's decision: every rank must run the same points.
  std::vector<bool> skip(m.points.size(), false);
  for (size_t k = 0; k < m.points.size(); ++k)
    skip[k] = opts.resume && existing.ok_point_ids.count(m.points[k].id()) > 0;
  if (dist != nullptr && !m.points.empty()) {
    auto skip_P = torch::zeros({static_cast<int64_t>(m.points.size())}, torch::kInt);
    for (size_t k = 0; k < skip.size(); ++k) skip_P[static_cast<int64_t>(k)].fill_(skip[k] ? 1 : 0);
    if (m.run.device == "cuda") {  // NCCL broadcasts device tensors
      skip_P = skip_P.to(torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(dist->env().local_rank)));
    }
    std::vector<torch::Tensor> t = {skip_P};
    dist->broadcast(t, 0, "the points to run");
    auto back = t[0].cpu();
    for (size_t k = 0; k < skip.size(); ++k) skip[k] = back[static_cast<int64_t>(k)].item<int>() != 0;
  }

  if (m.run.threads > 0) at::set_num_threads(static_cast<int>(m.run.threads));
  const torch::Device device(m.run.device == "cuda" ? torch::kCUDA : torch::kCPU);
  if (!device.is_cuda()) install_cpu_memory_tracking();
  const Provenance prov = collect_provenance(device);
  run_dir.write_records(m.resolved_toml, prov, dist, log);

  std::unique_ptr<TraceWriter> trace;
  if (!opts.trace_path.empty() && writer) trace = std::make_unique<TraceWriter>(opts.trace_path);
  RangeRecorder ranges(trace.get());

  std::unique_ptr<JsonlWriter> rows = run_dir.open_rows();
  const int64_t t0 = host_now_ns();
  int64_t to_run = 0;
  for (bool sk : skip) to_run += sk ? 0 : 1;
  // Groups: runs of consecutive points with the same model, seq_len and batch_size (the manifest
  // lists each group's points together), measured interleaved (measure_group).
  int64_t num_groups = 0;
  for (size_t k = 0; k < m.points.size(); ++k)
    num_groups += k == 0 || m.points[k].group_id() != m.points[k - 1].group_id();
  int64_t group_no = 0;
  for (size_t begin = 0; begin < m.points.size();) {
    size_t end = begin + 1;
    while (end < m.points.size() && m.points[end].group_id() == m.points[begin].group_id()) ++end;
    ++group_no;
    std::vector<const Point*> todo;
    std::vector<size_t> todo_index;
    for (size_t k = begin; k < end; ++k) {
      if (skip[k]) {
        ++sum.resumed;
        if (writer)
          log << fmt::format("[{}/{}] {}: already ok in results.jsonl, skipped\n", k + 1, sum.points, m.points[k].id());
        continue;
      }
      todo.push_back(&m.points[k]);
      todo_index.push_back(k);
    }
    const std::string label = fmt::format("group {}/{} {}", group_no, num_groups, m.points[begin].group_id());
    begin = end;
    if (todo.empty()) continue;
    if (writer && m.run.repetitions > 1) {
      log << fmt::format("  {}: {} points, {} warm-up steps each, then {} interleaved rounds of {} steps\n", label,
                         todo.size(), m.run.warmup_steps, m.run.repetitions, m.run.measure_steps);
    }
    GroupRows g = measure_group(m, todo, prov, &ranges, opts.profile_begin, opts.profile_end, opts.dist, &log, label);
    for (size_t t = 0; t < g.rows.size(); ++t) {
      nlohmann::json& row = g.rows[t];
      if (rows) rows->append(row);
      ++sum.ran;
      const bool ok = row["status"] == "ok";
      ok ? ++sum.ok : ++sum.failed;
      if (!writer) continue;
      const double elapsed = static_cast<double>(host_now_ns() - t0) * 1e-9;
      const double eta = elapsed / static_cast<double>(sum.ran) * static_cast<double>(to_run - sum.ran);
      std::string what =
          ok ? fmt::format(
                   "ok  step {:.2f} ms +-{:.1f}% (fwd {:.2f}, filter {:.2f}, bwd {:.2f} +-{:.1f}%, optim {:.2f})",
                   row["step_ms"].get<double>(), 100 * row["step_ms_rel_iqr"].get<double>(),
                   row["fwd_ms"].get<double>(), row["filter_ms"].get<double>(), row["bwd_ms"].get<double>(),
                   100 * row["bwd_ms_rel_iqr"].get<double>(), row["optim_ms"].get<double>())
             : fmt::format("{}: {}", row["status"].get<std::string>(), row["error"].get<std::string>());
      log << fmt::format("[{}/{}] {}: {} | elapsed {} ETA {}\n", todo_index[t] + 1, sum.points,
                         row["point_id"].get<std::string>(), what, hms(elapsed), hms(eta));
      log.flush();
    }
    if (trace) trace->write();
    if (g.first_failed >= 0) {
      // The other ranks may be inside a collective of this point: stop here (exiting closes this
      // rank's connections, so they fail fast instead of running mismatched collectives).
      const nlohmann::json& row = g.rows[static_cast<size_t>(g.first_failed)];
      throw DistributedError(fmt::format(
          "rank {} of {}: point {} failed ({}: {}); a data-parallel run stops at the first failing point{}",
          dist->rank(), dist->world_size(), row["point_id"].get<std::string>(), row["status"].get<std::string>(),
          row["error"].get<std::string>(), writer ? fmt::format(" (its row is in {})", results_path) : ""));
    }
  }
  if (trace) trace->write();
  return sum;
}

}  // namespace collider::harness
