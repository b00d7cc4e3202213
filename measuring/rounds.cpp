// Series and interleave (rounds.h).
#include "measuring/rounds.h"

#include "measuring/stats.h"

namespace collider::stats {

void Series::end_round() {
  round_medians_.push_back(
      stats::median(std::vector<double>(samples_.begin() + static_cast<std::ptrdiff_t>(round_begin_), samples_.end())));
  round_begin_ = samples_.size();
}

double Series::median() const { return stats::median(samples_); }
double Series::rel_iqr() const { return stats::rel_iqr(samples_); }

void interleave(size_t n, int64_t rounds, const Interleaving& how) {
  auto standing = [&](size_t j) { return !how.standing || how.standing(j); };
  auto stopped = [&] { return how.stop && how.stop(); };
  if (how.warm_up) {
    for (size_t j = 0; j < n && !stopped(); ++j)
      if (standing(j)) how.warm_up(j);
  }
  for (int64_t round = 0; round < rounds && !stopped(); ++round) {
    for (size_t k = 0; k < n && !stopped(); ++k) {
      const size_t j = serpentine(round, k, n);
      if (standing(j)) how.measure(j, round);
    }
    if (how.after_round) how.after_round(round);
  }
}

}  // namespace collider::stats
