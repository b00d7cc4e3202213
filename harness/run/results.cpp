// Result rows: schema, JSONL writer/reader, provenance (results.h).
#include "harness/run/results.h"

#include "base/fault.h"
#include "base/fsutil.h"
#include "measuring/memory.h"
#include "harness/components/ranges.h"

#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/headeronly/version.h>

#include <fmt/format.h>

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <type_traits>

#ifndef COLLIDER_SOURCE_DIR
#define COLLIDER_SOURCE_DIR "."
#endif

namespace collider::harness {

const std::vector<RowField>& required_row_fields() {
  using T = JsonType;
  static const std::vector<RowField> f = {
      // identity
      {"experiment", T::kString},
      {"point_id", T::kString},
      {"status", T::kString},
      {"error", T::kString},  // null when ok (checked separately)
      {"model", T::kString},
      {"seq_len", T::kInteger},
      {"batch_size", T::kInteger},
      {"filter_ratio", T::kNumber},
      {"method", T::kString},
      {"attention_grad", T::kString},
      {"dtype", T::kString},
      {"device", T::kString},
      // timing (ms, medians over measured steps)
      {"fwd_ms", T::kNumber},
      {"bwd_ms", T::kNumber},
      {"filter_ms", T::kNumber},
      {"optim_ms", T::kNumber},
      {"step_ms", T::kNumber},
      {"samples_step_ms", T::kArray},
      {"layers", T::kArray},
      // spread and interleaving: (q75 - q25) / median, and each repetition's median
      {"step_ms_rel_iqr", T::kNumber},
      {"bwd_ms_rel_iqr", T::kNumber},
      {"repetition_bwd_ms", T::kArray},
      {"group", T::kString},
      {"aa_copy", T::kBool},
      // work
      {"tokens", T::kInteger},
      {"tokens_kept", T::kInteger},
      {"flops_fwd", T::kNumber},
      {"flops_bwd", T::kNumber},
      {"tokens_per_s", T::kNumber},
      {"peak_mem_bytes", T::kInteger},
      // provenance
      {"git_sha", T::kString},
      {"git_dirty", T::kBool},
      {"torch_version", T::kString},
      {"cuda_version", T::kString},
      {"device_name", T::kString},
      {"num_threads", T::kInteger},
      {"timestamp", T::kString},
  };
  return f;
}

const std::vector<RowField>& measured_row_fields() {
  using T = JsonType;
  static const std::vector<RowField> f = {
      {"fwd_ms", T::kNumber},          {"bwd_ms", T::kNumber},          {"filter_ms", T::kNumber},
      {"optim_ms", T::kNumber},        {"step_ms", T::kNumber},         {"samples_step_ms", T::kArray},
      {"layers", T::kArray},           {"tokens_kept", T::kInteger},    {"flops_bwd", T::kNumber},
      {"tokens_per_s", T::kNumber},    {"peak_mem_bytes", T::kInteger}, {"mfu", T::kNumber},
      {"step_ms_rel_iqr", T::kNumber}, {"bwd_ms_rel_iqr", T::kNumber},  {"repetition_bwd_ms", T::kArray},
  };
  return f;
}

void write_kept_counts(nlohmann::json& row, const std::vector<int64_t>& kept_per_row) {
  if (kept_per_row.empty()) return;
  double sum = 0;
  for (int64_t n : kept_per_row) sum += static_cast<double>(n);
  row["kept_per_row_min"] = *std::min_element(kept_per_row.begin(), kept_per_row.end());
  row["kept_per_row_max"] = *std::max_element(kept_per_row.begin(), kept_per_row.end());
  row["kept_per_row_mean"] = sum / static_cast<double>(kept_per_row.size());
}

void clear_measurements(nlohmann::json& row) {
  for (const auto& f : measured_row_fields()) {
    row[f.key] = f.type == JsonType::kArray ? nlohmann::json::array() : nlohmann::json(nullptr);
  }
}

namespace {
bool is_measured(const std::string& key) {
  const auto& m = measured_row_fields();
  return std::any_of(m.begin(), m.end(), [&](const RowField& f) { return key == f.key; });
}
bool has_type(const nlohmann::json& v, JsonType t) {
  switch (t) {
    case JsonType::kString:
      return v.is_string();
    case JsonType::kInteger:
      return v.is_number_integer();
    case JsonType::kNumber:
      return v.is_number();
    case JsonType::kBool:
      return v.is_boolean();
    case JsonType::kArray:
      return v.is_array();
    case JsonType::kObject:
      return v.is_object();
  }
  return false;
}
const char* type_name(JsonType t) {
  switch (t) {
    case JsonType::kString:
      return "string";
    case JsonType::kInteger:
      return "integer";
    case JsonType::kNumber:
      return "number";
    case JsonType::kBool:
      return "boolean";
    case JsonType::kArray:
      return "array";
    case JsonType::kObject:
      return "object";
  }
  return "?";
}
}  // namespace

std::vector<std::string> validate_row(const nlohmann::json& row) {
  std::vector<std::string> problems;
  if (!row.is_object()) return {"row is not a JSON object"};
  const std::string status = row.value("status", std::string());
  const bool ok = status == "ok";
  if (status != "ok" && status != "oom" && status != "error" && status != "skipped") {
    problems.push_back("status '" + status + "' is not one of ok, oom, error, skipped");
  }
  for (const auto& f : required_row_fields()) {
    if (!row.contains(f.key)) {
      problems.push_back(std::string("missing key '") + f.key + "'");
      continue;
    }
    const auto& v = row.at(f.key);
    if (std::string(f.key) == "error") {
      if (ok ? !v.is_null() : !v.is_string()) {
        problems.push_back(ok ? "key 'error' must be null in an ok row" : "key 'error' must be a message string");
      }
      continue;
    }
    if (std::string(f.key) == "cuda_version" && v.is_null()) continue;  // no CUDA
    if (v.is_null() && !ok && is_measured(f.key)) continue;
    if (!has_type(v, f.type)) {
      problems.push_back(std::string("key '") + f.key + "' must be " + type_name(f.type) + ", got " + v.type_name());
    }
  }
  if (ok && row.contains("samples_step_ms") && row["samples_step_ms"].is_array()) {
    if (row["samples_step_ms"].empty()) problems.push_back("samples_step_ms is empty in an ok row");
    for (const auto& s : row["samples_step_ms"]) {
      if (!s.is_number()) problems.push_back("samples_step_ms holds a non-number");
    }
  }
  // forward_drop's middle layers see fewer tokens than T: its timing rows say how many (its FLOPs
  // count them). Training rows (they carry "step") need not.
  if (row.value("method", std::string()) == "forward_drop" && !row.contains("step")) {
    const auto it = row.find("middle_tokens_per_seq");
    if (it == row.end() || !it->is_number_integer() || it->get<int64_t>() < 1) {
      problems.push_back(
          "a forward_drop row needs 'middle_tokens_per_seq', an integer >= 1 (its middle layers' tokens "
          "per row)");
    }
  }
  if (row.contains("layers") && row["layers"].is_array()) {
    for (const auto& l : row["layers"]) {
      if (!l.is_object() || !l.contains("name") || !l["name"].is_string() || !l.contains("fwd_ms") ||
          !l["fwd_ms"].is_number() || !l.contains("bwd_ms") || !l["bwd_ms"].is_number()) {
        problems.push_back("layers entry is not {name: string, fwd_ms: number, bwd_ms: number}: " + l.dump());
      }
    }
  }
  return problems;
}

JsonlWriter::JsonlWriter(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    throw std::runtime_error("results: cannot open '" + path + "' for appending: " + std::strerror(errno));
  }
}

JsonlWriter::~JsonlWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void JsonlWriter::append(const nlohmann::json& row) {
  // One buffer, one write: with O_APPEND a reader never sees half of a row from a finished
  // write, and a kill leaves at worst one torn last line (which read_results cuts). A failed or
  // short write (no space, file size limit) is cut back to the previous end, so the file keeps
  // whole lines only, and ends the run with the file's name and the errno text.
  const std::string line = row.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    const int e = errno;
    throw fsutil::WriteError("results: cannot append to '" + path_ + "': " + std::strerror(e), e);
  }
  const off_t before = st.st_size;  // the run holds the directory's lock: no other writer appends
  auto fail = [&](int e, size_t written) {
    std::string what = "results: cannot append a row to '" + path_ + "': " + std::strerror(e);
    if (written > 0 && ::ftruncate(fd_, before) != 0) {
      what += fmt::format(" (and cutting the partial row back failed: {}; --resume cuts it)", std::strerror(errno));
    } else {
      what += "; the rows written so far are intact: free space, then --resume continues the run";
    }
    throw fsutil::WriteError(what, e);
  };
  // Tests only (COLLIDER_FAULT_AT=row_append): write the first half alone and maybe die there.
  size_t done = 0;
  if (fault::armed("row_append")) {
    const ssize_t n = ::write(fd_, line.data(), line.size() / 2);
    if (n < 0) fail(errno, 0);
    done = static_cast<size_t>(n);
    fault::hit("row_append");
  }
  while (done < line.size()) {  // one write of the whole line; a loop only for a short write
    const ssize_t n = ::write(fd_, line.data() + done, line.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail(n < 0 ? errno : ENOSPC, done);
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd_) != 0) fail(errno, done);
}

ExistingResults read_results(const std::string& path, bool repair) {
  ExistingResults out;
  std::ifstream in(path, std::ios::binary);
  if (!in) return out;
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  size_t pos = 0, good_end = 0;
  while (pos < text.size()) {
    const size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) break;  // torn tail
    const std::string line = text.substr(pos, nl - pos);
    pos = nl + 1;
    if (line.empty()) {
      good_end = pos;
      continue;
    }
    auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) {
      if (pos == text.size()) break;  // a torn last line that happens to end in a newline
      ++out.bad_lines;
      good_end = pos;
      continue;
    }
    if (j.value("status", std::string()) == "ok" && j.contains("point_id") && j["point_id"].is_string()) {
      out.ok_point_ids.insert(j["point_id"].get<std::string>());
    }
    out.rows.push_back(std::move(j));
    good_end = pos;
  }
  out.torn_bytes = static_cast<int64_t>(text.size() - good_end);
  if (repair && out.torn_bytes > 0) {
    if (::truncate(path.c_str(), static_cast<off_t>(good_end)) != 0) {
      throw std::runtime_error("results: cannot cut the torn last line of '" + path + "': " + std::strerror(errno));
    }
  }
  return out;
}

Provenance collect_provenance(const torch::Device& device) {
  return collider::collect_provenance(device, COLLIDER_SOURCE_DIR);
}

nlohmann::json to_json(const Provenance& p) {
  nlohmann::json j = nlohmann::json::object();
  for_each_field(p, [&](const char* key, const auto& value) {
    if constexpr (std::is_same_v<std::decay_t<decltype(value)>, const std::string*>) {
      j[key] = value ? nlohmann::json(*value) : nlohmann::json(nullptr);
    } else {
      j[key] = value;
    }
  });
  return j;
}

nlohmann::json identity_row(const RowIdentity& id, const Provenance& prov) {
  nlohmann::json row = {{"experiment", id.experiment},
                        {"point_id", id.point_id},
                        {"status", "ok"},
                        {"error", nullptr},
                        {"model", id.model},
                        {"seq_len", id.seq_len},
                        {"batch_size", id.batch_size},
                        {"filter_ratio", id.filter_ratio},
                        {"method", id.method},
                        {"attention_grad", id.attention_grad},
                        {"dtype", id.dtype},
                        {"device", id.device}};
  row.update(to_json(prov));
  return row;
}

nlohmann::json environment_record(const Provenance& p) {
  auto j = to_json(p);
  j["time"] = utc_timestamp();
  j["cuda_available"] = torch::cuda::is_available();
  j["cuda_device_count"] = torch::cuda::is_available() ? static_cast<int64_t>(torch::cuda::device_count()) : 0;
  j["nvtx"] = nvtx_enabled();
  j["interop_threads"] = at::get_num_interop_threads();
  j["parallel_info"] = at::get_parallel_info();
  j["cpu_allocator"] = memory::cpu_allocator_mode();  // caching | tracking | system (measuring/memory.h)
  j["cpu_cache_limit_mib"] = memory::cpu_cache_limit_bytes() >> 20;
  j["source_dir"] = COLLIDER_SOURCE_DIR;
  return j;
}

std::string utc_timestamp() {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

std::string local_stamp() {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  localtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y%m%d-%H%M%S", &tm);
  return buf;
}

}  // namespace collider::harness
