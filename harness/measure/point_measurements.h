// What the steps of one point add up to while its group is measured (harness/measure/group.h):
// every step's timings, each interleaved round's medians, per-layer medians, kept counts, peak
// memory, process CPU time and the rewrite's statistics, written into the point's row as the
// measured keys of DESIGN.md section 6.
#pragma once

#include "harness/components/distributed.h"
#include "harness/components/train_step.h"
#include "measuring/rounds.h"

#include <collider/collider.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace collider::harness {

// What the steps of one point add up to: the step loop feeds it every step (warm-up steps only
// count for the losses), and the row's measured keys are written from it.
class PointMeasurements {
 public:
  explicit PointMeasurements(int rank) : rank_(rank) {}

  // Before the first measured step of a repetition.
  void begin_measured();

  void add_step(const StepResult& r, bool measured);

  // After the last step of a repetition (device synchronised): its peak memory and CPU time.
  void end_repetition(int64_t peak_bytes);

  // run.copy_probe: one cold copy of the bytes the rewrite cut (probes.h), per repetition.
  void add_copy_probe(double ms) { copy_ms_.add(ms); }
  int64_t bytes_gathered() const { return filter_stats_.bytes_gathered; }  // last measured step

  void set_timer_kind(std::string kind) { timer_kind_ = std::move(kind); }
  void set_overlaps(bool overlaps) { overlaps_ = overlaps; }

  double step_ms() const;
  double last_repetition_step_ms() const { return step_.last_round_median(); }
  int64_t kept_per_seq() const { return kept_per_seq_; }
  const std::vector<int64_t>& kept_per_row() const { return kept_per_row_; }  // this rank's, last measured step

  // Timings, per-layer medians, kept counts, memory, losses, rewrite statistics.
  void write(nlohmann::json& row, const ProcessGroup* dist, const std::string& peak_mem_method) const;

 private:
  int rank_;
  stats::Series step_, fwd_, bwd_;  // with each repetition's median
  stats::Series copy_ms_;           // run.copy_probe
  std::vector<double> filter_, select_, rewrite_, optim_, losses_, allreduce_, ar_wait_, ar_bucket_;
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

}  // namespace collider::harness
