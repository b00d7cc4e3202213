// Result rows (DESIGN.md section 6): the schema, an append-only JSONL writer that writes each
// row with one write(2) and fsyncs it (an interrupted run leaves only complete lines), the
// reader used by --resume (which cuts a torn last line), and the provenance record (env.json).
// Tests: tests/test_results.cpp.
#pragma once

#include "measuring/provenance.h"

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cstdint>
#include <set>
#include <string>
#include <vector>

namespace collider::harness {

enum class JsonType { kString, kInteger, kNumber, kBool, kArray, kObject };

struct RowField {
  const char* key;
  JsonType type;
};

// Every key DESIGN.md section 6 requires of a timing row, with its JSON type.
const std::vector<RowField>& required_row_fields();

// The measured keys of a timing row (timings, per-layer times, kept tokens, backward FLOPs,
// throughput, peak memory, MFU): null (arrays: empty) until measured and in every row whose status
// is not "ok", so that a failed point leaves no partial measurement behind. The one list: the
// sweep clears them, the validator accepts them null in a failed row.
const std::vector<RowField>& measured_row_fields();
// Sets every measured key of `row` to null (arrays: empty).
void clear_measurements(nlohmann::json& row);

// kept_per_row_min / _max / _mean of one step's kept count per row (they differ under
// batch_topk); nothing for an empty list. Timing and training rows both carry them.
void write_kept_counts(nlohmann::json& row, const std::vector<int64_t>& kept_per_row);

// Problems of one row against the schema (empty = valid): missing keys, wrong types, bad
// status, layers entries without {name, fwd_ms, bwd_ms}.
std::vector<std::string> validate_row(const nlohmann::json& row);

// Appends rows to a JSONL file: O_APPEND, one write per line, fsync per row.
class JsonlWriter {
 public:
  explicit JsonlWriter(const std::string& path);
  ~JsonlWriter();
  JsonlWriter(const JsonlWriter&) = delete;
  JsonlWriter& operator=(const JsonlWriter&) = delete;
  void append(const nlohmann::json& row);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

struct ExistingResults {
  std::vector<nlohmann::json> rows;    // complete, parseable rows
  std::set<std::string> ok_point_ids;  // point_id of rows with status "ok"
  int64_t torn_bytes = 0;              // bytes of an incomplete last line (cut when repairing)
  int64_t bad_lines = 0;               // complete lines that are not JSON objects
};

// Reads DIR/results.jsonl; a missing file is empty. With repair, an incomplete last line (no
// newline or not valid JSON: a run killed mid-write) is cut so that appending stays clean.
ExistingResults read_results(const std::string& path, bool repair);

// What the numbers ran on (measuring/provenance.h), collected in this checkout
// (COLLIDER_SOURCE_DIR).
using Provenance = collider::Provenance;
Provenance collect_provenance(const torch::Device& device);
nlohmann::json to_json(const Provenance& p);
// env.json: provenance plus the time and the build's optional components.
nlohmann::json environment_record(const Provenance& p);

// What every result row starts with (DESIGN.md section 6), timing and training rows alike: the
// point it measured, status "ok" with no error, and the run's provenance.
struct RowIdentity {
  std::string experiment, point_id, model;
  int64_t seq_len = 0, batch_size = 0;
  double filter_ratio = 0.0;
  std::string method, attention_grad, dtype, device;
};
nlohmann::json identity_row(const RowIdentity& id, const Provenance& prov);

// ISO 8601 UTC, e.g. 2026-11-30T01:23:45Z; and local "YYYYmmdd-HHMMSS" for directory names.
std::string utc_timestamp();
std::string local_stamp();

}  // namespace collider::harness
