// Order statistics of timing samples, shared by the sweep's rows and the benchmarks: the median,
// quantiles (linear interpolation between closest ranks, numpy's default) and the relative
// interquartile range, (q75 - q25) / median, the spread every timing table prints (as nvbench
// reports its noise relative to the centre). Empty input gives 0 (no samples, no spread).
// Tests: tests/test_stats.cpp.
#pragma once

#include <vector>

namespace collider::stats {

// q in [0, 1]; 0 for an empty vector.
double quantile(std::vector<double> v, double q);
double median(const std::vector<double>& v);
// (q75 - q25) / median; 0 when the median is 0 or there are no samples.
double rel_iqr(const std::vector<double>& v);

}  // namespace collider::stats
