// Order statistics of timing samples (stats.h).
#include "measuring/stats.h"

#include <algorithm>
#include <cmath>

namespace collider::stats {

double quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const double pos = std::clamp(q, 0.0, 1.0) * static_cast<double>(v.size() - 1);
  const auto lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (pos - static_cast<double>(lo)) * (v[hi] - v[lo]);
}

double median(const std::vector<double>& v) { return quantile(v, 0.5); }

double rel_iqr(const std::vector<double>& v) {
  const double m = median(v);
  if (v.empty() || m == 0.0) return 0.0;
  return (quantile(v, 0.75) - quantile(v, 0.25)) / std::abs(m);
}

}  // namespace collider::stats
