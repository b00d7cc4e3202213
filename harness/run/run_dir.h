// The output directory of one `collider run`, timing sweep and training run alike (DESIGN.md
// section 6): where it is, its lock, the rows already in it (resume), the resolved manifest and
// environment records, the row writer, and the exit status of a run that failed. Only rank 0
// (the writer) touches files; the other ranks of a data-parallel run get an object that does not.
// Tests: tests/test_run_lock.cpp, tests/test_sweep.cpp, tests/test_write_failures.cpp.
#pragma once

#include "harness/run/results.h"
#include "harness/run/run_lock.h"

#include <exception>
#include <iosfwd>
#include <memory>
#include <string>

namespace collider::harness {

class ProcessGroup;

// `collider run`'s output directory when --out is not given: results/<name>/<date-time>, or with
// resume the newest existing one (throws std::runtime_error saying to pass --out when none exists).
std::string default_run_dir(const std::string& name, bool resume);

// Exit status of a `collider run` (sweep or training) that threw `e`, after saying why on `err`:
// 3 for a failed data-parallel run (every rank ends), 1 for any other error.
int run_failure_status(std::ostream& err, const std::string& rank_tag, std::exception_ptr e);

class RunDir {
 public:
  // The writer creates `dir`, takes its lock (a second run on it is refused, naming the holder)
  // and reads results.jsonl, cutting a torn last line on resume. Without resume, a directory that
  // already holds rows is refused (std::runtime_error). Other ranks: nothing is touched.
  RunDir(std::string dir, bool resume, bool writer, std::ostream& log);

  // manifest.resolved.toml (replaced; on resume a changed one is noted on `log`) and env.json, or
  // beside the first run's env.json on resume env.resume-<date-time>.json, with the world size and
  // back-end of a data-parallel run. Writer only.
  void write_records(const std::string& resolved_toml, const Provenance& prov, const ProcessGroup* dist,
                     std::ostream& log) const;

  // The row writer (results.jsonl, appended); null on the other ranks.
  std::unique_ptr<JsonlWriter> open_rows() const;

  const std::string& dir() const { return dir_; }
  const std::string& results_path() const { return results_path_; }
  const ExistingResults& existing() const { return existing_; }  // empty on the other ranks
  bool resume() const { return resume_; }
  bool writer() const { return writer_; }

 private:
  std::string dir_, results_path_;
  bool resume_, writer_;
  RunDirLock lock_;
  ExistingResults existing_;
};

}  // namespace collider::harness
