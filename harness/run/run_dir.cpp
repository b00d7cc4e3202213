// The output directory of one `collider run` (run_dir.h).
#include "harness/run/run_dir.h"

#include "harness/components/distributed.h"
#include "base/fault.h"
#include "base/fsutil.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <ostream>
#include <stdexcept>

namespace collider::harness {

std::string default_run_dir(const std::string& name, bool resume) {
  const std::string base = fsutil::join("results", name);
  if (!resume) return fsutil::join(base, local_stamp());
  const auto runs = fsutil::list_subdirs(base);  // date-time names sort chronologically
  if (runs.empty()) {
    throw std::runtime_error("--resume without --out needs an earlier run under " + base +
                             "/; none found (pass --out DIR)");
  }
  return fsutil::join(base, runs.back());
}

int run_failure_status(std::ostream& err, const std::string& rank_tag, std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const DistributedError& d) {
    err << "collider run: distributed run failed: " << d.what() << "\n";
    return 3;
  } catch (const std::exception& x) {
    err << "collider run: " << rank_tag << "error: " << x.what() << "\n";
  }  // anything else propagates, as before
  return 1;
}

RunDir::RunDir(std::string dir, bool resume, bool writer, std::ostream& log)
    : dir_(std::move(dir)), results_path_(fsutil::join(dir_, "results.jsonl")), resume_(resume), writer_(writer) {
  if (!writer_) return;
  // Rank 0 alone writes the directory, so rank 0 alone locks it (held to the end of the run); a
  // refusal comes before any compute, and the other ranks fail at their next collective.
  fsutil::make_dirs(dir_);
  lock_ = RunDirLock::acquire(dir_);
  fault::hold("run_locked");
  existing_ = read_results(results_path_, /*repair=*/resume_);
  if (!resume_ && !existing_.rows.empty()) {
    throw std::runtime_error(
        fmt::format("{} already holds {} rows; pass --resume to continue that run, or choose another --out directory",
                    results_path_, existing_.rows.size()));
  }
  if (resume_ && existing_.torn_bytes > 0) {
    log << fmt::format("resume: cut an incomplete last line ({} bytes) from {}\n", existing_.torn_bytes, results_path_);
  }
}

void RunDir::write_records(const std::string& resolved_toml, const Provenance& prov, const ProcessGroup* dist,
                           std::ostream& log) const {
  if (!writer_) return;
  const std::string resolved_path = fsutil::join(dir_, "manifest.resolved.toml");
  if (resume_ && fsutil::exists(resolved_path) && fsutil::read_file(resolved_path) != resolved_toml) {
    log << "resume: the resolved manifest differs from the one saved in " << resolved_path
        << "; the new one replaces it (rows keep their own settings)\n";
  }
  fsutil::write_file_atomic(resolved_path, resolved_toml);
  // On resume the first run's env.json stays; this invocation's record goes beside it.
  const std::string env_name = resume_ && fsutil::exists(fsutil::join(dir_, "env.json"))
                                   ? "env.resume-" + local_stamp() + ".json"
                                   : std::string("env.json");
  nlohmann::json env = environment_record(prov);
  if (dist != nullptr) {
    env["world_size"] = dist->world_size();
    env["distributed_backend"] = dist->backend();
  }
  fsutil::write_file_atomic(fsutil::join(dir_, env_name), env.dump(2) + "\n");
}

std::unique_ptr<JsonlWriter> RunDir::open_rows() const {
  return writer_ ? std::make_unique<JsonlWriter>(results_path_) : nullptr;
}

}  // namespace collider::harness
