// Result rows (harness/run/results.h): rows from a real point validate against the DESIGN.md
// section 6 schema (every key, the right JSON types) and the validator catches missing keys and
// wrong types; the JSONL writer/reader round trip; a torn last line is cut on repair only;
// provenance fields.
// Run: OMP_NUM_THREADS=1 build-harness/tests/test_results
#include "base/fsutil.h"
#include "harness/config/manifest.h"
#include "harness/run/results.h"
#include "harness/measure/group.h"

#include "temp_dir.h"

#include <gtest/gtest.h>
#include <torch/version.h>

#include <unistd.h>

#include <regex>

namespace ch = collider::harness;
namespace fsu = collider::fsutil;

namespace {

// Scratch directories: tests/temp_dir.h.
struct TempDir : collider::testing::TempDir {
  TempDir() : collider::testing::TempDir("results") {}
};

ch::Manifest tiny_manifest(const std::vector<std::string>& sets = {}) {
  return ch::load_manifest_text(R"(
name = "rows"
[run]
device = "cpu"
warmup_steps = 1
measure_steps = 2
threads = 1
[axes]
model = "tinyllama-debug"
seq_len = 32
batch_size = 2
filter_ratio = 0.5
method = "loss_only"
)",
                                "rows.toml", sets);
}

nlohmann::json good_row() {
  auto m = tiny_manifest();
  const auto prov = ch::collect_provenance(torch::kCPU);
  return ch::measure_point(m, m.points.at(0), prov, nullptr);
}

bool mentions(const std::vector<std::string>& problems, const std::string& what) {
  for (const auto& p : problems) {
    if (p.find(what) != std::string::npos) return true;
  }
  return false;
}

}  // namespace

TEST(Results, RowOfARealPointValidates) {
  auto row = good_row();
  ASSERT_EQ(row["status"], "ok") << row.dump();
  const auto problems = ch::validate_row(row);
  EXPECT_TRUE(problems.empty()) << problems.front();
  EXPECT_EQ(row["tokens"], 64);
  EXPECT_EQ(row["tokens_kept"], 32);
  EXPECT_EQ(row["samples_step_ms"].size(), 2u);
  EXPECT_EQ(row["layers"].size(), 5u);  // embedding, 2 layers, final_norm, lm_head
  EXPECT_EQ(row["layers"][1]["name"], "layer.00");
  EXPECT_GT(row["flops_fwd"].get<double>(), 0);
  EXPECT_EQ(row["flops_bwd"].get<double>(), row["flops_bwd_dense"].get<double>());  // loss_only: dense backward
  EXPECT_GT(row["peak_mem_bytes"].get<int64_t>(), 0);
  EXPECT_EQ(row["peak_mem_method"], "cpu_tracking_allocator_peak_live_tensor_bytes");
  EXPECT_TRUE(row["mfu"].is_null());  // no known peak for a CPU
  EXPECT_TRUE(row.contains("attention_linear_ratio"));
  EXPECT_TRUE(row.contains("layers_bwd_coverage"));
}

TEST(Results, ValidatorCatchesMissingKeysAndWrongTypes) {
  auto row = good_row();
  for (const auto& f : ch::required_row_fields()) {
    auto broken = row;
    broken.erase(f.key);
    EXPECT_TRUE(mentions(ch::validate_row(broken), std::string("missing key '") + f.key)) << f.key;
  }
  auto t1 = row;
  t1["seq_len"] = "32";
  EXPECT_TRUE(mentions(ch::validate_row(t1), "'seq_len' must be integer"));
  auto t2 = row;
  t2["bwd_ms"] = nullptr;  // null timing only in a failed row
  EXPECT_TRUE(mentions(ch::validate_row(t2), "'bwd_ms' must be number"));
  auto t3 = row;
  t3["layers"] = nlohmann::json::array({{{"name", "x"}}});
  EXPECT_TRUE(mentions(ch::validate_row(t3), "layers entry"));
  auto t4 = row;
  t4["status"] = "fine";
  EXPECT_TRUE(mentions(ch::validate_row(t4), "status 'fine'"));
  auto t5 = row;
  t5["git_dirty"] = "yes";
  EXPECT_TRUE(mentions(ch::validate_row(t5), "'git_dirty' must be boolean"));
}

TEST(Results, FailedPointRowValidatesWithNullTimings) {
  auto m = tiny_manifest({"run.fail_point=loss_only"});
  auto row = ch::measure_point(m, m.points.at(0), ch::collect_provenance(torch::kCPU), nullptr);
  EXPECT_EQ(row["status"], "error");
  EXPECT_NE(row["error"].get<std::string>().find("injected failure"), std::string::npos);
  EXPECT_TRUE(row["bwd_ms"].is_null());
  EXPECT_TRUE(row["layers"].empty());
  const auto problems = ch::validate_row(row);
  EXPECT_TRUE(problems.empty()) << problems.front();
  row["error"] = nullptr;
  EXPECT_TRUE(mentions(ch::validate_row(row), "'error' must be a message"));
}

TEST(Results, JsonlWriterAndReaderRoundTrip) {
  TempDir tmp;
  const std::string path = tmp / "results.jsonl";
  {
    ch::JsonlWriter w(path);
    w.append({{"point_id", "a"}, {"status", "ok"}});
    w.append({{"point_id", "b"}, {"status", "error"}});
    w.append({{"point_id", "c"}, {"status", "ok"}, {"text", "line\nbreak"}});  // escaped, still one line
  }
  auto r = ch::read_results(path, false);
  ASSERT_EQ(r.rows.size(), 3u);
  EXPECT_EQ(r.ok_point_ids, (std::set<std::string>{"a", "c"}));
  EXPECT_EQ(r.torn_bytes, 0);
  EXPECT_EQ(r.rows[2]["text"], "line\nbreak");
  EXPECT_TRUE(ch::read_results(tmp / "missing.jsonl", true).rows.empty());
}

TEST(Results, TornLastLineIsCutOnlyWhenRepairing) {
  TempDir tmp;
  const std::string path = tmp / "results.jsonl";
  const std::string good = "{\"point_id\":\"a\",\"status\":\"ok\"}\n";
  const std::string torn = "{\"point_id\":\"b\",\"sta";
  fsu::write_file(path, good + torn);
  auto r = ch::read_results(path, false);
  EXPECT_EQ(r.rows.size(), 1u);
  EXPECT_GT(r.torn_bytes, 0);
  EXPECT_EQ(r.torn_bytes, static_cast<int64_t>(torn.size()));
  EXPECT_EQ(fsu::read_file(path), good + torn);  // untouched
  r = ch::read_results(path, true);
  EXPECT_EQ(r.rows.size(), 1u);
  EXPECT_EQ(fsu::read_file(path), good);
  // A torn line that ends in a newline (killed between the bytes and a retry) is cut too.
  fsu::write_file(path, good + "{\"point_id\":\n");
  r = ch::read_results(path, true);
  EXPECT_EQ(fsu::read_file(path), good);
  // A bad line in the middle is counted, not cut.
  fsu::write_file(path, good + "garbage\n" + good);
  r = ch::read_results(path, true);
  EXPECT_EQ(r.bad_lines, 1);
  EXPECT_EQ(r.rows.size(), 2u);
}

TEST(Results, Provenance) {
  const auto p = ch::collect_provenance(torch::kCPU);
  EXPECT_EQ(p.torch_version, TORCH_VERSION);  // the torch this test was compiled against
  EXPECT_TRUE(p.git_sha == "unknown" || std::regex_match(p.git_sha, std::regex("[0-9a-f]{40}"))) << p.git_sha;
  EXPECT_FALSE(p.device_name.empty());
  EXPECT_GT(p.num_threads, 0);
  const auto env = ch::environment_record(p);
  for (const char* k :
       {"git_sha", "git_dirty", "torch_version", "cuda_version", "device_name", "num_threads", "hostname", "time"}) {
    EXPECT_TRUE(env.contains(k)) << k;
  }
  EXPECT_TRUE(std::regex_match(ch::utc_timestamp(), std::regex(R"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)")));
}

TEST(Results, FsUtilHelpers) {
  TempDir tmp;
  fsu::make_dirs(tmp / "a/b/c");
  fsu::make_dirs(tmp / "a/b2");
  EXPECT_TRUE(fsu::is_directory(tmp / "a/b/c"));
  EXPECT_EQ(fsu::list_subdirs(tmp / "a"), (std::vector<std::string>{"b", "b2"}));
  fsu::write_file(tmp / "a/b/c/f.txt", "x");
  fsu::rename_path(tmp / "a/b/c/f.txt", tmp / "a/g.txt");
  EXPECT_EQ(fsu::read_file(tmp / "a/g.txt"), "x");
  fsu::remove_tree(tmp / "a");
  EXPECT_FALSE(fsu::exists(tmp / "a"));
}
