// The sweep: runs a manifest's points group by group through the measurement engine
// (harness/measure/group.h: the points that share model, seq_len and batch_size measured
// interleaved on one model, with run.aa_check the group's regular point twice), appends each
// group's rows to DIR/results.jsonl when the group ends (DESIGN.md section 6), and goes on past a
// failing point (its row has the status and message); --resume skips points whose row is
// already "ok". Progress on stderr: one line per round of a group, one per point (i/n, elapsed,
// ETA). Data-parallel (SweepOptions::dist, harness/components/distributed.h): every rank runs
// every point on its slice of the same global batch (batch_size rows per rank) with gradients
// all-reduced; only rank 0 writes files and rows (world_size recorded); the run ends after the
// group of the first failing point.
// Tests: tests/test_sweep.cpp, tests/test_trace.cpp, tests/test_distributed.cpp.
#pragma once

#include "harness/components/distributed.h"
#include "harness/config/manifest.h"
#include "harness/measure/group.h"

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

}  // namespace collider::harness
