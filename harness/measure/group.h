// The measurement engine: methods measured side by side on one model. A group is the points of a
// manifest that share model, seq_len and batch_size; they are measured interleaved on one model
// and one trainer, and each becomes a row of DESIGN.md section 6 (identity, provenance, the
// measured keys of point_measurements.h, the analytic work and the FLOP ideal). The sweep
// (harness/recipes/sweep.h) runs a manifest's groups through it.
// Tests: tests/test_sweep.cpp, tests/test_results.cpp, tests/test_layer_timing_slow.cpp,
// tests/test_distributed.cpp.
#pragma once

#include "harness/components/distributed.h"
#include "harness/components/ranges.h"
#include "harness/config/manifest.h"
#include "harness/run/results.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

namespace collider::harness {

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
// `log` (may be null) gets one progress line per round, labelled `group_label`; steps
// [profile_begin, profile_end) of every point are bracketed by cudaProfilerStart/Stop.
GroupRows measure_group(const Manifest& m, const std::vector<const Point*>& points, const Provenance& prov,
                        RangeRecorder* ranges, int64_t profile_begin, int64_t profile_end,
                        const std::shared_ptr<ProcessGroup>& dist, std::ostream* log, const std::string& group_label);

// Measures one point and returns its row (never throws for a failing point: the row carries
// status and error). `ranges` may be null. With `dist`, rank r trains on rows [r*B, (r+1)*B) of
// a global batch of world_size*B rows, and a DistributedError is thrown, not turned into a row.
nlohmann::json measure_point(const Manifest& manifest, const Point& point, const Provenance& prov,
                             RangeRecorder* ranges, int64_t profile_begin = -1, int64_t profile_end = -1,
                             const std::shared_ptr<ProcessGroup>& dist = nullptr);

// Peak dense bf16 FLOP/s of a known device (H100/H200: 989e12), else 0 (MFU left null).
double device_peak_flops(const std::string& device_name, const std::string& dtype);

}  // namespace collider::harness
