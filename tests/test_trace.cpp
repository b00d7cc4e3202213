// Trace files (harness/components/ranges.h): the Chrome/Perfetto JSON that `collider run --trace FILE`
// writes is valid JSON whose ranges nest properly (a child lies inside its parent, siblings do
// not overlap), and it carries the same names as the timings: fwd, filter, bwd, optimizer and
// every layer's <name>.fwd / <name>.bwd, each inside its phase — on the plain and on the
// Collider-rewritten graph.
// Run: OMP_NUM_THREADS=1 build-harness/tests/test_trace
#include "harness/recipes/cli.h"
#include "base/fsutil.h"
#include "harness/components/ranges.h"
#include "harness/components/train_step.h"
#include "models/model.h"

#include "harness/run/results.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <algorithm>
#include <map>
#include <sstream>

namespace ch = collider::harness;
namespace cm = collider::models;
namespace fsu = collider::fsutil;

namespace {

struct Ev {
  std::string name;
  double begin, end;
};

std::string trace_path(const char* tag) {
  return "/tmp/collider_test_trace_" + std::to_string(::getpid()) + "_" + tag + ".json";
}

// Parses the file (throws on invalid JSON) and returns its complete ("X") events.
std::vector<Ev> load_events(const std::string& path) {
  const auto doc = nlohmann::json::parse(fsu::read_file(path));
  std::vector<Ev> out;
  for (const auto& e : doc.at("traceEvents")) {
    if (e.at("ph") != "X") continue;
    const double ts = e.at("ts").get<double>(), dur = e.at("dur").get<double>();
    EXPECT_GE(dur, 0.0) << e.dump();
    out.push_back({e.at("name").get<std::string>(), ts, ts + dur});
  }
  return out;
}

// Empty when every pair of ranges is either nested or disjoint; else the first violation.
std::string nesting_violation(std::vector<Ev> ev) {
  const double eps = 1e-3;  // microseconds; timestamps have nanosecond resolution
  std::sort(ev.begin(), ev.end(),
            [](const Ev& a, const Ev& b) { return a.begin != b.begin ? a.begin < b.begin : a.end > b.end; });
  std::vector<Ev> stack;
  for (const auto& e : ev) {
    while (!stack.empty() && stack.back().end <= e.begin + eps) stack.pop_back();
    if (!stack.empty() && e.end > stack.back().end + eps) {
      return "'" + e.name + "' [" + std::to_string(e.begin) + ", " + std::to_string(e.end) + "] overlaps '" +
             stack.back().name + "' [" + std::to_string(stack.back().begin) + ", " + std::to_string(stack.back().end) +
             "]";
    }
    stack.push_back(e);
  }
  return "";
}

// True when some range named `parent` encloses `e`.
bool inside_one_of(const Ev& e, const std::vector<Ev>& all, const std::string& parent) {
  for (const auto& p : all) {
    if (p.name == parent && p.begin <= e.begin + 1e-3 && e.end <= p.end + 1e-3) return true;
  }
  return false;
}

}  // namespace

TEST(Trace, NestingCheckerCatchesOverlaps) {
  EXPECT_EQ(nesting_violation({{"a", 0, 10}, {"b", 1, 5}, {"c", 5, 9}, {"d", 10, 12}}), "");
  EXPECT_NE(nesting_violation({{"a", 0, 10}, {"b", 5, 12}}), "");
}

TEST(Trace, RecorderWritesValidNestedRanges) {
  const std::string path = trace_path("recorder");
  {
    ch::TraceWriter w(path);
    ch::RangeRecorder r(&w);
    {
      ch::ScopedRange outer(&r, "outer \"quoted\"");
      { ch::ScopedRange a(&r, "a"); }
      {
        ch::ScopedRange b(&r, "b");
        ch::ScopedRange c(&r, "c");
      }
    }
    EXPECT_EQ(r.open_ranges(), 0);
    w.write();
    w.write();  // rewriting is fine
  }
  const auto ev = load_events(path);
  ASSERT_EQ(ev.size(), 4u);
  EXPECT_EQ(nesting_violation(ev), "");
  EXPECT_TRUE(std::any_of(ev.begin(), ev.end(), [](const Ev& e) { return e.name == "outer \"quoted\""; }));
  ::unlink(path.c_str());
}

TEST(Trace, TrainingStepsGiveTheTimingNamesProperlyNested) {
  for (auto method : {ch::Method::kRegular, ch::Method::kCollider}) {
    SCOPED_TRACE(ch::to_string(method));
    const std::string path = trace_path(ch::to_string(method));
    {
      ch::TraceWriter w(path);
      ch::RangeRecorder ranges(&w);
      ch::StepConfig c;
      c.spec.method = method;
      c.filter_ratio = method == ch::Method::kRegular ? 0.0 : 0.5;
      c.layer_timing = true;
      ch::Trainer t(cm::build_model(cm::preset("phi-1.5-debug")), c, torch::kCPU, 0, &ranges);
      torch::Generator g = at::detail::createCPUGenerator(1);
      for (int s = 0; s < 2; ++s) t.step(ch::random_batch(2, 32, 256, g, torch::kCPU));
      EXPECT_EQ(ranges.open_ranges(), 0);
      w.write();
    }
    const auto ev = load_events(path);
    EXPECT_EQ(nesting_violation(ev), "");
    std::map<std::string, int> count;
    for (const auto& e : ev) ++count[e.name];
    for (const char* name : {"step", "fwd", "filter", "filter.select", "filter.rewrite", "bwd", "optimizer",
                             "embedding.fwd", "layer.00.fwd", "layer.01.fwd", "final_norm.fwd", "lm_head.fwd",
                             "lm_head.bwd", "final_norm.bwd", "layer.01.bwd", "layer.00.bwd", "embedding.bwd"}) {
      EXPECT_EQ(count[name], 2) << name;
    }
    for (const auto& e : ev) {
      const auto n = e.name.size();
      const bool layer_fwd = n > 4 && e.name.compare(n - 4, 4, ".fwd") == 0;
      const bool layer_bwd = n > 4 && e.name.compare(n - 4, 4, ".bwd") == 0;
      const bool phase = e.name == "fwd" || e.name == "bwd" || e.name == "optimizer" || e.name == "filter";
      if (layer_fwd) { EXPECT_TRUE(inside_one_of(e, ev, "fwd")) << e.name; }
      if (layer_bwd) { EXPECT_TRUE(inside_one_of(e, ev, "bwd")) << e.name; }
      if (phase) { EXPECT_TRUE(inside_one_of(e, ev, "step")) << e.name; }
    }
    ::unlink(path.c_str());
  }
}

namespace {

// Runs `collider run MANIFEST --trace` in a fresh DIR (DIR/m.toml, DIR/out, DIR/t.json) and
// returns the trace's events; the run's stderr goes to *err.
std::vector<Ev> traced_run(const std::string& dir, const char* manifest, std::string* err_text) {
  fsu::remove_tree(dir);
  fsu::make_dirs(dir);
  fsu::write_file(dir + "/m.toml", manifest);
  std::ostringstream out, err;
  const int rc = ch::run_run_command({dir + "/m.toml", "--out", dir + "/out", "--trace", dir + "/t.json"}, out, err);
  *err_text = err.str();
  EXPECT_EQ(rc, 0) << err.str();
  return rc == 0 ? load_events(dir + "/t.json") : std::vector<Ev>{};
}

}  // namespace

TEST(Trace, CliTraceFlagWritesTheFile) {
  const std::string dir = "/tmp/collider_test_trace_cli_" + std::to_string(::getpid());
  std::string err;
  const auto ev = traced_run(dir, R"(
name = "trace"
[run]
device = "cpu"
warmup_steps = 1
measure_steps = 1
[axes]
model = "tinyllama-debug"
seq_len = 32
filter_ratio = [0.0, 0.5]
method = ["regular", "loss_only"]
)",
                             &err);
  ASSERT_FALSE(ev.empty());
  EXPECT_EQ(nesting_violation(ev), "");
  int points = 0, measured = 0;
  for (const auto& e : ev) {
    points += e.name.rfind("point ", 0) == 0;
    measured += e.name.rfind("measure.", 0) == 0;
  }
  EXPECT_EQ(points, 4);
  EXPECT_EQ(measured, 4);
  fsu::remove_tree(dir);
}

// The points of one group (same model, T, batch) share one warm-up and then take turns, one
// round of measured steps each, so drift on a shared machine hits them alike.
TEST(Trace, RepetitionsInterleaveThePointsOfAGroup) {
  const std::string dir = "/tmp/collider_test_trace_interleave_" + std::to_string(::getpid());
  std::string err;
  auto ev = traced_run(dir, R"(
name = "interleave"
[run]
device = "cpu"
warmup_steps = 1
measure_steps = 2
repetitions = 3
aa_check = true
[axes]
model = "tinyllama-debug"
seq_len = 32
filter_ratio = 0.5
method = ["regular", "loss_only"]
)",
                       &err);
  ASSERT_FALSE(ev.empty());
  EXPECT_EQ(nesting_violation(ev), "");
  std::sort(ev.begin(), ev.end(), [](const Ev& a, const Ev& b) { return a.begin < b.begin; });
  std::vector<std::string> order;
  for (const auto& e : ev) {
    if (e.name.rfind("point ", 0) == 0 || e.name.rfind("warm-up ", 0) == 0) order.push_back(e.name);
  }
  const std::string reg = "tinyllama-debug/T32/B1/f0.5/regular/none", lo = "tinyllama-debug/T32/B1/f0.5/loss_only/none";
  std::vector<std::string> want = {"warm-up " + reg, "warm-up " + lo, "warm-up " + reg + "/aa"};
  // Serpentine rounds: forward, reversed, forward.
  for (const auto& id : {reg, lo, reg + "/aa"}) want.push_back("point " + id);
  for (const auto& id : {reg + "/aa", lo, reg}) want.push_back("point " + id);
  for (const auto& id : {reg, lo, reg + "/aa"}) want.push_back("point " + id);
  EXPECT_EQ(order, want);
  const auto rows = ch::read_results(dir + "/out/results.jsonl", false).rows;
  ASSERT_EQ(rows.size(), 3u);
  for (const auto& row : rows) {
    EXPECT_TRUE(ch::validate_row(row).empty()) << row.dump();
    EXPECT_EQ(row["samples_bwd_ms"].size(), 6u) << "every measured step of every round";
    EXPECT_EQ(row["repetition_bwd_ms"].size(), 3u);
    EXPECT_GE(row["bwd_ms_rel_iqr"].get<double>(), 0.0);
    EXPECT_EQ(row["group"], "tinyllama-debug/T32/B1");
    EXPECT_EQ(row["group_points"], 3);
  }
  EXPECT_EQ(rows[2]["aa_copy"], true);
  EXPECT_NE(err.find("round 3/3"), std::string::npos) << err;
  fsu::remove_tree(dir);
}

TEST(Trace, ProfilerCaptureIsANoOpWithoutCuda) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "CUDA present: the capture range is live";
  EXPECT_FALSE(ch::cuda_profiler_start());
  EXPECT_FALSE(ch::cuda_profiler_stop());
}
