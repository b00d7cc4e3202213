// The sweep (sweep.h): resume decisions (rank 0's, broadcast), run records, then the manifest's
// groups through the measurement engine (harness/measure/group.h), each group's rows appended,
// a progress line per point and the group's table (harness/measure/table.h).
#include "harness/recipes/sweep.h"

#include "base/duration.h"
#include "measuring/memory.h"
#include "harness/components/timer.h"
#include "harness/measure/table.h"
#include "harness/run/run_dir.h"

#include <fmt/format.h>

#include <iostream>

namespace collider::harness {

SweepSummary run_sweep(const Manifest& m, const SweepOptions& opts) {
  std::ostream& log = opts.log ? *opts.log : std::cerr;
  SweepSummary sum;
  sum.points = static_cast<int64_t>(m.points.size());
  if (opts.out_dir.empty()) throw std::runtime_error("run_sweep: no output directory given");
  ProcessGroup* dist = opts.dist.get();
  const bool writer = dist == nullptr || dist->rank() == 0;  // only rank 0 touches files
  const RunDir run_dir(opts.out_dir, opts.resume, writer, log);
  const std::string& results_path = run_dir.results_path();
  sum.results_path = results_path;
  const ExistingResults& existing = run_dir.existing();
  // Which points to skip (--resume) is rank 0's decision: every rank must run the same points.
  std::vector<bool> skip(m.points.size(), false);
  for (size_t k = 0; k < m.points.size(); ++k)
    skip[k] = opts.resume && existing.ok_point_ids.count(m.points[k].id()) > 0;
  if (dist != nullptr && !m.points.empty()) {
    auto skip_P = torch::zeros({static_cast<int64_t>(m.points.size())}, torch::kInt);
    for (size_t k = 0; k < skip.size(); ++k) skip_P[static_cast<int64_t>(k)].fill_(skip[k] ? 1 : 0);
    if (m.run.device == "cuda") {  // NCCL broadcasts device tensors
      skip_P = skip_P.to(torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(dist->env().local_rank)));
    }
    std::vector<torch::Tensor> t = {skip_P};
    dist->broadcast(t, 0, "the points to run");
    auto back = t[0].cpu();
    for (size_t k = 0; k < skip.size(); ++k) skip[k] = back[static_cast<int64_t>(k)].item<int>() != 0;
  }

  if (m.run.threads > 0) at::set_num_threads(static_cast<int>(m.run.threads));
  const torch::Device device(m.run.device == "cuda" ? torch::kCUDA : torch::kCPU);
  if (!device.is_cuda()) memory::install_cpu_memory_tracking();
  const Provenance prov = collect_provenance(device);
  run_dir.write_records(m.resolved_toml, prov, dist, log);

  std::unique_ptr<TraceWriter> trace;
  if (!opts.trace_path.empty() && writer) trace = std::make_unique<TraceWriter>(opts.trace_path);
  RangeRecorder ranges(trace.get());

  std::unique_ptr<JsonlWriter> rows = run_dir.open_rows();
  const int64_t t0 = host_now_ns();
  int64_t to_run = 0;
  for (bool sk : skip) to_run += sk ? 0 : 1;
  // Groups: runs of consecutive points with the same model, seq_len and batch_size (the manifest
  // lists each group's points together), measured interleaved (measure_group).
  int64_t num_groups = 0;
  for (size_t k = 0; k < m.points.size(); ++k)
    num_groups += k == 0 || m.points[k].group_id() != m.points[k - 1].group_id();
  int64_t group_no = 0;
  for (size_t begin = 0; begin < m.points.size();) {
    size_t end = begin + 1;
    while (end < m.points.size() && m.points[end].group_id() == m.points[begin].group_id()) ++end;
    ++group_no;
    std::vector<const Point*> todo;
    std::vector<size_t> todo_index;
    for (size_t k = begin; k < end; ++k) {
      if (skip[k]) {
        ++sum.resumed;
        if (writer)
          log << fmt::format("[{}/{}] {}: already ok in results.jsonl, skipped\n", k + 1, sum.points, m.points[k].id());
        continue;
      }
      todo.push_back(&m.points[k]);
      todo_index.push_back(k);
    }
    const std::string label = fmt::format("group {}/{} {}", group_no, num_groups, m.points[begin].group_id());
    begin = end;
    if (todo.empty()) continue;
    if (writer && m.run.repetitions > 1) {
      log << fmt::format("  {}: {} points, {} warm-up steps each, then {} interleaved rounds of {} steps\n", label,
                         todo.size(), m.run.warmup_steps, m.run.repetitions, m.run.measure_steps);
    }
    GroupRows g = measure_group(m, todo, prov, &ranges, opts.profile_begin, opts.profile_end, opts.dist, &log, label);
    for (const auto& row : g.rows) {
      if (rows) rows->append(row);
      ++sum.ran;
      row["status"] == "ok" ? ++sum.ok : ++sum.failed;
    }
    // The group's points finish together: one elapsed time and one estimate for what is left.
    const double elapsed = static_cast<double>(host_now_ns() - t0) * 1e-9;
    const double eta = elapsed / static_cast<double>(sum.ran) * static_cast<double>(to_run - sum.ran);
    for (size_t t = 0; t < g.rows.size() && writer; ++t) {
      const nlohmann::json& row = g.rows[t];
      const bool ok = row["status"] == "ok";
      std::string what =
          ok ? fmt::format(
                   "ok  step {:.2f} ms +-{:.1f}% (fwd {:.2f}, filter {:.2f}, bwd {:.2f} +-{:.1f}%, optim {:.2f})",
                   row["step_ms"].get<double>(), 100 * row["step_ms_rel_iqr"].get<double>(),
                   row["fwd_ms"].get<double>(), row["filter_ms"].get<double>(), row["bwd_ms"].get<double>(),
                   100 * row["bwd_ms_rel_iqr"].get<double>(), row["optim_ms"].get<double>())
             : fmt::format("{}: {}", row["status"].get<std::string>(), row["error"].get<std::string>());
      log << fmt::format("[{}/{}] {}: {} | elapsed {} ETA {}\n", todo_index[t] + 1, sum.points,
                         row["point_id"].get<std::string>(), what, hms(elapsed), hms(eta));
      log.flush();
    }
    if (writer) {
      log << fmt::format("  {}: backward, medians over {} measured steps per point\n{}", label,
                         m.run.repetitions * m.run.measure_steps, group_table(g.rows));
      log.flush();
    }
    if (trace) trace->write();
    if (g.first_failed >= 0) {
      // The other ranks may be inside a collective of this point: stop here (exiting closes this
      // rank's connections, so they fail fast instead of running mismatched collectives).
      const nlohmann::json& row = g.rows[static_cast<size_t>(g.first_failed)];
      throw DistributedError(fmt::format(
          "rank {} of {}: point {} failed ({}: {}); a data-parallel run stops at the first failing point{}",
          dist->rank(), dist->world_size(), row["point_id"].get<std::string>(), row["status"].get<std::string>(),
          row["error"].get<std::string>(), writer ? fmt::format(" (its row is in {})", results_path) : ""));
    }
  }
  if (trace) trace->write();
  return sum;
}

}  // namespace collider::harness
