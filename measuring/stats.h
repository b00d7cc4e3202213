// Order statistics of timing samples, shared by the sweep's rows and the benchmarks: the median,
// quantiles (linear interpolation between closest ranks, numpy's default) and the relative
// interquartile range, (q75 - q25) / median, the spread every timing table prints (as nvbench
// reports its noise relative to the centre). Empty input gives 0 (no samples, no spread). And
// the serpentine order of interleaved rounds.
// Tests: tests/test_stats.cpp.
#pragma once

#include <cstddef>
#include <vector>

namespace collider::stats {

// q in [0, 1]; 0 for an empty vector.
double quantile(std::vector<double> v, double q);
double median(const std::vector<double>& v);
// (q75 - q25) / median; 0 when the median is 0 or there are no samples.
double rel_iqr(const std::vector<double>& v);

// Interleaved rounds in serpentine order: the j-th of n items to run in round `round` (even
// rounds forward, odd rounds reversed). A drift inside a round (the machine speeding up or
// slowing down while it runs) then favours the late items in one round and the early ones in the
// next, instead of the same items every round. Used by the timing sweeps and the benchmarks.
inline size_t serpentine(long long round, size_t j, size_t n) { return round % 2 == 0 ? j : n - 1 - j; }

}  // namespace collider::stats
