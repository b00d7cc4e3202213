// PointMeasurements (point_measurements.h): the measured keys of a point's row.
#include "harness/measure/point_measurements.h"

#include "measuring/stats.h"
#include "harness/run/results.h"

#include <collider/filter_stats_fields.h>

#include <algorithm>

#include <time.h>

namespace collider::harness {

using stats::median;

namespace {

int64_t process_cpu_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

}  // namespace

void PointMeasurements::begin_measured() {
  cpu_ns_begin_ = process_cpu_ns();
}

void PointMeasurements::add_step(const StepResult& r, bool measured) {
  losses_.push_back(r.loss);
  if (!measured) return;
  fwd_.add(r.fwd_ms);
  bwd_.add(r.bwd_ms);
  filter_.push_back(r.filter_ms);
  select_.push_back(r.select_ms);
  rewrite_.push_back(r.rewrite_ms);
  optim_.push_back(r.optim_ms);
  step_.add(r.step_ms);
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

void PointMeasurements::end_repetition(int64_t peak_bytes) {
  measured_cpu_ns_ += process_cpu_ns() - cpu_ns_begin_;
  peak_ = std::max(peak_, peak_bytes);
  // This repetition's steps are the samples since begin_measured.
  step_.end_round();
  fwd_.end_round();
  bwd_.end_round();
}

double PointMeasurements::step_ms() const { return step_.median(); }

void PointMeasurements::write(nlohmann::json& row, const ProcessGroup* dist, const std::string& peak_mem_method) const {
  row["fwd_ms"] = fwd_.median();
  row["bwd_ms"] = bwd_.median();
  row["filter_ms"] = median(filter_);
  row["optim_ms"] = median(optim_);
  row["step_ms"] = step_.median();
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
  row["samples_step_ms"] = step_.samples();
  row["samples_fwd_ms"] = fwd_.samples();
  row["samples_bwd_ms"] = bwd_.samples();
  // The spread, as nvbench reports it: (q75 - q25) / median over every measured step of every
  // repetition; and each interleaved repetition's median (the tables pair them across methods).
  row["step_ms_rel_iqr"] = step_.rel_iqr();
  row["fwd_ms_rel_iqr"] = fwd_.rel_iqr();
  row["bwd_ms_rel_iqr"] = bwd_.rel_iqr();
  row["repetition_step_ms"] = step_.round_medians();
  row["repetition_fwd_ms"] = fwd_.round_medians();
  row["repetition_bwd_ms"] = bwd_.round_medians();
  row["timer"] = timer_kind_;
  // CPU time this process used per measured step (all its threads): on a shared machine,
  // wall time well above it (times the threads) means the process waited for a core.
  row["process_cpu_ms_per_step"] =
      static_cast<double>(measured_cpu_ns_) * 1e-6 / static_cast<double>(std::max<size_t>(1, step_.samples().size()));
  double layers_fwd_sum = 0, layers_bwd_sum = 0;
  nlohmann::json layers = nlohmann::json::array();
  for (const auto& name : layer_names_) {
    const double f = median(layer_fwd_.at(name)), b = median(layer_bwd_.at(name));
    layers_fwd_sum += f;
    layers_bwd_sum += b;
    layers.push_back({{"name", name}, {"fwd_ms", f}, {"bwd_ms", b}});
  }
  row["layers"] = layers;
  // run.copy_probe (collider points): the median cold copy of the bytes the rewrite cut, the floor
  // of any rewrite that copies them (harness/measure/probes.h).
  if (!copy_ms_.samples().empty()) row["copy_floor_ms"] = copy_ms_.median();
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
  nlohmann::json& fs = row["filter_stats"] = nlohmann::json::object();
  for_each_filter_stats_field([&](const char* name, auto member) { fs[name] = filter_stats_.*member; });
}

}  // namespace collider::harness
