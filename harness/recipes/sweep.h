// Runs a manifest's points in groups: the points that share model, seq_len and batch_size are
// measured interleaved on one model (one warm-up of warmup_steps per point, then `repetitions`
// rounds in which every point takes measure_steps in turn, odd rounds in reverse order; with
// run.aa_check the group's regular point runs twice). Per point: medians and relative IQRs of every timing, each round's medians,
// per-layer medians, peak memory, analytic FLOPs, one JSONL row appended to DIR/results.jsonl
// when its group ends (DESIGN.md section 6). A failing point (error, OOM) becomes a row with its
// status and message and the sweep goes on; --resume skips points whose row is already "ok".
// Progress on stderr: one line per round of a group, one per point (i/n, elapsed, ETA).
// Data-parallel (SweepOptions::dist, harness/components/distributed.h): every rank runs every point on its
// slice of the same global batch (batch_size rows per rank) with gradients all-reduced; only
// rank 0 writes files and rows (world_size recorded); the run ends after the group of the first
// failing point.
// Tests: tests/test_sweep.cpp, tests/test_trace.cpp, tests/test_layer_timing_slow.cpp,
// tests/test_distributed.cpp.
#pragma once

#include "harness/components/distributed.h"
#include "harness/config/manifest.h"
#include "harness/components/ranges.h"
#include "harness/run/results.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <iosfwd>
#include <memory>
#include <string>

namespace collider::harness {

struct SweepOptions {
  std::string out_dir;         // required: where results.jsonl, manifest.resolved.toml, env.json go
  bool resume = false;         // skip points already ok in out_dir/results.jsonl
  std::string trace_path;      // Chrome/Perfetto trace of every range; empty = none
  int64_t profile_begin = -1;  // steps [begin, end) of every point bracketed by cudaProfilerStart/Stop
  int64_t profile_end = -1;
  std::ostream* log = nullptr;         // progress lines (default std::cerr)
  std::shared_ptr<ProcessGroup> dist;  // data-parallel run (null: one process)
};

struct SweepSummary {
  int64_t points = 0;   // in the manifest after exclusion
  int64_t ran = 0;      // measured in this invocation
  int64_t resumed = 0;  // skipped: already ok in results.jsonl
  int64_t ok = 0;
  int64_t failed = 0;  // rows with status oom / error written in this invocation
  std::string results_path;
};

// Throws std::runtime_error for set-up problems (results.jsonl already holds rows and resume is
// off, the directory cannot be created); point failures become rows instead, except in a
// data-parallel run, where a failed point (its row written by rank 0) or a DistributedError ends it.
SweepSummary run_sweep(const Manifest& manifest, const SweepOptions& opts);

// Measures one point and returns its row (never throws for a failing point: the row carries
// status and error). `ranges` may be null. With `dist`, rank r trains on rows [r*B, (r+1)*B) of
// a global batch of world_size*B rows, and a DistributedError is thrown, not turned into a row.
nlohmann::json measure_point(const Manifest& manifest, const Point& point, const Provenance& prov,
                             RangeRecorder* ranges, int64_t profile_begin = -1, int64_t profile_end = -1,
                             const std::shared_ptr<ProcessGroup>& dist = nullptr);

// Peak dense bf16 FLOP/s of a known device (H100/H200: 989e12), else 0 (MFU left null).
double device_peak_flops(const std::string& device_name, const std::string& dtype);

}  // namespace collider::harness
