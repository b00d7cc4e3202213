// The sweep (sweep.h) in three steps: resume (which points results.jsonl already holds ok; rank 0's
// decision, broadcast), grouping (the manifest's runs of points with the same model, seq_len and
// batch), and reporting (each group's rows appended, a progress line per point and the group's
// table, harness/measure/table.h); between them the measurement engine (harness/measure/group.h)
// measures each group.
#include "harness/recipes/sweep.h"

#include "base/duration.h"
#include "measuring/memory.h"
#include "harness/components/timer.h"
#include "harness/measure/table.h"
#include "harness/run/run_dir.h"

#include <fmt/format.h>

#include <algorithm>
#include <iostream>

namespace collider::harness {
namespace {

// Resume: which points to skip, those already "ok" in results.jsonl (--resume). Rank 0's decision
// (it read the file), broadcast: every rank must run the same points.
std::vector<bool> points_to_skip(const Manifest& m, const ExistingResults& existing, bool resume, ProcessGroup* dist) {
  std::vector<bool> skip(m.points.size(), false);
  for (size_t k = 0; k < m.points.size(); ++k) skip[k] = resume && existing.ok_point_ids.count(m.points[k].id()) > 0;
  if (dist == nullptr || m.points.empty()) return skip;
  auto skip_P = torch::zeros({static_cast<int64_t>(m.points.size())}, torch::kInt);
  for (size_t k = 0; k < skip.size(); ++k) skip_P[static_cast<int64_t>(k)].fill_(skip[k] ? 1 : 0);
  if (m.run.device == "cuda") {  // NCCL broadcasts device tensors
    skip_P = skip_P.to(torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(dist->env().local_rank)));
  }
  std::vector<torch::Tensor> t = {skip_P};
  dist->broadcast(t, 0, "the points to run");
  auto back = t[0].cpu();
  for (size_t k = 0; k < skip.size(); ++k) skip[k] = back[static_cast<int64_t>(k)].item<int>() != 0;
  return skip;
}

// One group of the sweep: its points to measure and those resume skips.
struct PointGroup {
  std::string label;               // "group g/G <group id>"
  std::vector<const Point*> todo;  // to measure, in manifest order
  std::vector<size_t> todo_index;  // their indices in the manifest
  std::vector<size_t> skipped;     // indices of the points resume skips
};

// Grouping: runs of consecutive points with the same model, seq_len and batch_size (the manifest
// lists each group's points together), measured interleaved (measure_group).
std::vector<PointGroup> group_points(const Manifest& m, const std::vector<bool>& skip) {
  std::vector<PointGroup> groups;
  for (size_t begin = 0; begin < m.points.size();) {
    size_t end = begin + 1;
    while (end < m.points.size() && m.points[end].group_id() == m.points[begin].group_id()) ++end;
    PointGroup g;
    g.label = m.points[begin].group_id();  // "group g/G" is prefixed once G is known
    for (size_t k = begin; k < end; ++k) {
      if (skip[k]) {
        g.skipped.push_back(k);
      } else {
        g.todo.push_back(&m.points[k]);
        g.todo_index.push_back(k);
      }
    }
    groups.push_back(std::move(g));
    begin = end;
  }
  for (size_t i = 0; i < groups.size(); ++i)
    groups[i].label = fmt::format("group {}/{} {}", i + 1, groups.size(), groups[i].label);
  return groups;
}

// Reporting: before a group is measured, the points resume skipped and the group's plan; after, its
// rows appended to results.jsonl and counted in the summary, one progress line per point (elapsed,
// ETA), the group's table and the trace so far. Progress lines come from rank 0 only.
class SweepReport {
 public:
  SweepReport(const Manifest& m, SweepSummary& sum, JsonlWriter* rows, TraceWriter* trace, bool writer, int64_t to_run,
              std::ostream& log)
      : m_(m), sum_(sum), rows_(rows), trace_(trace), writer_(writer), to_run_(to_run), log_(log) {}

  void group_starts(const PointGroup& g) {
    for (size_t k : g.skipped) {
      ++sum_.resumed;
      if (writer_)
        log_ << fmt::format("[{}/{}] {}: already ok in results.jsonl, skipped\n", k + 1, sum_.points,
                            m_.points[k].id());
    }
    if (writer_ && !g.todo.empty() && m_.run.repetitions > 1) {
      log_ << fmt::format("  {}: {} points, {} warm-up steps each, then {} interleaved rounds of {} steps\n", g.label,
                          g.todo.size(), m_.run.warmup_steps, m_.run.repetitions, m_.run.measure_steps);
    }
  }

  void group_ends(const PointGroup& g, const GroupRows& measured) {
    for (const auto& row : measured.rows) {
      if (rows_) rows_->append(row);
      ++sum_.ran;
      row["status"] == "ok" ? ++sum_.ok : ++sum_.failed;
    }
    // The group's points finish together: one elapsed time and one estimate for what is left.
    const double elapsed = static_cast<double>(host_now_ns() - t0_) * 1e-9;
    const double eta = elapsed / static_cast<double>(sum_.ran) * static_cast<double>(to_run_ - sum_.ran);
    for (size_t t = 0; t < measured.rows.size() && writer_; ++t) {
      log_ << fmt::format("[{}/{}] {}: {} | elapsed {} ETA {}\n", g.todo_index[t] + 1, sum_.points,
                          measured.rows[t]["point_id"].get<std::string>(), outcome(measured.rows[t]), hms(elapsed),
                          hms(eta));
      log_.flush();
    }
    if (writer_) {
      log_ << fmt::format("  {}: backward, medians over {} measured steps per point\n{}", g.label,
                          m_.run.repetitions * m_.run.measure_steps, group_table(measured.rows));
      log_.flush();
    }
    if (trace_) trace_->write();
  }

 private:
  // A point's progress line after its id: its step and phase times, or its status and error.
  static std::string outcome(const nlohmann::json& row) {
    if (row["status"] != "ok")
      return fmt::format("{}: {}", row["status"].get<std::string>(), row["error"].get<std::string>());
    return fmt::format("ok  step {:.2f} ms +-{:.1f}% (fwd {:.2f}, filter {:.2f}, bwd {:.2f} +-{:.1f}%, optim {:.2f})",
                       row["step_ms"].get<double>(), 100 * row["step_ms_rel_iqr"].get<double>(),
                       row["fwd_ms"].get<double>(), row["filter_ms"].get<double>(), row["bwd_ms"].get<double>(),
                       100 * row["bwd_ms_rel_iqr"].get<double>(), row["optim_ms"].get<double>());
  }

  const Manifest& m_;
  SweepSummary& sum_;
  JsonlWriter* rows_;   // null on the ranks that do not write
  TraceWriter* trace_;  // null: no --trace
  const bool writer_;
  const int64_t to_run_;  // points to measure in this invocation
  std::ostream& log_;
  const int64_t t0_ = host_now_ns();
};

// A data-parallel run stops after the group of its first failing point: the other ranks may be
// inside a collective of this point (exiting closes this rank's connections, so they fail fast
// instead of running mismatched collectives).
DistributedError failed_point_error(const GroupRows& g, const ProcessGroup& dist, bool writer,
                                    const std::string& results_path) {
  const nlohmann::json& row = g.rows[static_cast<size_t>(g.first_failed)];
  return DistributedError(
      fmt::format("rank {} of {}: point {} failed ({}: {}); a data-parallel run stops at the first failing point{}",
                  dist.rank(), dist.world_size(), row["point_id"].get<std::string>(), row["status"].get<std::string>(),
                  row["error"].get<std::string>(), writer ? fmt::format(" (its row is in {})", results_path) : ""));
}

}  // namespace

SweepSummary run_sweep(const Manifest& m, const SweepOptions& opts) {
  std::ostream& log = opts.log ? *opts.log : std::cerr;
  SweepSummary sum;
  sum.points = static_cast<int64_t>(m.points.size());
  if (opts.out_dir.empty()) throw std::runtime_error("run_sweep: no output directory given");
  ProcessGroup* dist = opts.dist.get();
  const bool writer = dist == nullptr || dist->rank() == 0;  // only rank 0 touches files
  const RunDir run_dir(opts.out_dir, opts.resume, writer, log);
  sum.results_path = run_dir.results_path();
  const std::vector<bool> skip = points_to_skip(m, run_dir.existing(), opts.resume, dist);

  if (m.run.threads > 0) at::set_num_threads(static_cast<int>(m.run.threads));
  const torch::Device device(m.run.device == "cuda" ? torch::kCUDA : torch::kCPU);
  if (!device.is_cuda()) memory::install_cpu_memory_tracking();
  const Provenance prov = collect_provenance(device);
  run_dir.write_records(m.resolved_toml, prov, dist, log);
  std::unique_ptr<TraceWriter> trace;
  if (!opts.trace_path.empty() && writer) trace = std::make_unique<TraceWriter>(opts.trace_path);
  RangeRecorder ranges(trace.get());
  std::unique_ptr<JsonlWriter> rows = run_dir.open_rows();

  SweepReport report(m, sum, rows.get(), trace.get(), writer, std::count(skip.begin(), skip.end(), false), log);
  for (const PointGroup& group : group_points(m, skip)) {
    report.group_starts(group);
    if (group.todo.empty()) continue;
    const GroupRows g =
        measure_group(m, group.todo, prov, &ranges, opts.profile_begin, opts.profile_end, opts.dist, &log, group.label);
    report.group_ends(group, g);
    if (g.first_failed >= 0) throw failed_point_error(g, *dist, writer, sum.results_path);
  }
  if (trace) trace->write();
  return sum;
}

}  // namespace collider::harness
