// The order every side-by-side measurement runs its variants in, and what one timed quantity of a
// variant adds up to over it. interleave(): each variant's warm-up in the order given, then
// `rounds` rounds in which every variant still standing runs once, in serpentine order (even
// rounds forward, odd rounds reversed: measuring/stats.h), so drift on a shared machine hits every
// variant alike and each round pairs their medians. Series: the samples of one quantity, each
// round's median, the median and relative IQR of all of them.
// Used by the measurement engine (harness/measure/group.h) and, through the Python bindings,
// python/bench/bench_hf_backward.py.
// Tests: tests/test_stats.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

namespace collider::stats {

class Series {
 public:
  void add(double v) { samples_.push_back(v); }
  // Closes a round: the median of the samples added since the last end_round().
  void end_round();
  double median() const;
  double rel_iqr() const;  // (q75 - q25) / median of every sample
  const std::vector<double>& samples() const { return samples_; }
  const std::vector<double>& round_medians() const { return round_medians_; }
  double last_round_median() const { return round_medians_.empty() ? 0.0 : round_medians_.back(); }

 private:
  std::vector<double> samples_, round_medians_;
  size_t round_begin_ = 0;  // index of the open round's first sample
};

struct Interleaving {
  std::function<void(size_t variant)> warm_up;                 // may be empty: no warm-up
  std::function<void(size_t variant, int64_t round)> measure;  // one variant's block of a round
  std::function<bool(size_t variant)> standing;                // empty: every variant stands
  std::function<void(int64_t round)> after_round;              // may be empty
  std::function<bool()> stop;                                  // empty: never; true ends the rounds early
};

// Runs n variants: warm-ups in order, then `rounds` serpentine rounds, as above. A variant that is
// not standing (it failed) is skipped from then on.
void interleave(size_t n, int64_t rounds, const Interleaving& how);

}  // namespace collider::stats
