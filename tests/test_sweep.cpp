// Sweeps end to end through `collider run` (harness/recipes/cli.h, harness/recipes/sweep.h): rows for every
// point, each valid against the schema; the resolved manifest and env.json saved; a forced
// failing point yields a status row, the sweep goes on, the exit code is non-zero; --resume after
// a killed run (a real SIGKILL of the CLI, and a torn last line) completes the sweep with no
// duplicate rows; a directory holding rows is refused without --resume; the CPU peak-memory
// probe grows with the batch and the caching allocator stays exact past its limit; the smoke
// manifest (all four methods) runs; forward_drop rows count its middle layers' tokens in their
// FLOPs; run.floor's T' floor points are measured in their group and tabulated; real text scored
// by excess loss (run.data) puts batch_topk and per-sequence selection in one group's rounds.
// Run: OMP_NUM_THREADS=1 build-harness/tests/test_sweep
#include "harness/recipes/cli.h"
#include "base/fsutil.h"
#include "harness/components/token_data.h"
#include "measuring/memory.h"
#include "harness/run/results.h"
#include "models/flops.h"

#include "temp_dir.h"
#include "utility_test_util.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/version.h>

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <map>
#include <sstream>
#include <thread>

extern char** environ;

namespace ch = collider::harness;
namespace fsu = collider::fsutil;

namespace {

// Scratch directories: tests/temp_dir.h.
struct TempDir : collider::testing::TempDir {
  TempDir() : collider::testing::TempDir("sweep") {}
};

const char* kManifest = R"(
name = "sweep-test"
[run]
device = "cpu"
warmup_steps = 1
measure_steps = 2
threads = 1
[axes]
model = "tinyllama-debug"
seq_len = [16, 32]
batch_size = 1
filter_ratio = [0.0, 0.5]
method = ["regular", "loss_only"]
[[exclude]]
method = "regular"
filter_ratio = 0.5
)";

struct Run {
  int rc;
  std::string out, err;
};

Run run(const std::vector<std::string>& args) {
  std::ostringstream out, err;
  const int rc = ch::run_run_command(args, out, err);
  return {rc, out.str(), err.str()};
}

std::vector<nlohmann::json> rows_of(const std::string& dir) {
  return ch::read_results(fsu::join(dir, "results.jsonl"), false).rows;
}

}  // namespace

TEST(Sweep, WritesOneValidRowPerPointAndTheRunRecords) {
  TempDir tmp;
  fsu::write_file(tmp / "m.toml", kManifest);
  const auto r = run({tmp / "m.toml", "--out", tmp / "out", "--set", "run.seed=3"});
  ASSERT_EQ(r.rc, 0) << r.err;
  const auto rows = rows_of(tmp / "out");
  ASSERT_EQ(rows.size(), 6u);  // 2 seq_len x (regular@0, loss_only@0, loss_only@0.5)
  std::set<std::string> ids;
  for (const auto& row : rows) {
    const auto problems = ch::validate_row(row);
    EXPECT_TRUE(problems.empty()) << row["point_id"] << ": " << problems.front();
    EXPECT_EQ(row["experiment"], "sweep-test");
    EXPECT_EQ(row["seed"], 3);
    ids.insert(row["point_id"].get<std::string>());
  }
  EXPECT_EQ(ids.size(), rows.size());
  const std::string resolved = fsu::read_file(tmp / "out/manifest.resolved.toml");
  EXPECT_NE(resolved.find("seed = 3"), std::string::npos) << resolved;
  EXPECT_NE(resolved.find("override run.seed = 3"), std::string::npos);
  const auto env = nlohmann::json::parse(fsu::read_file(tmp / "out/env.json"));
  EXPECT_EQ(env["torch_version"], TORCH_VERSION);  // the torch this test was compiled against
  EXPECT_NE(r.err.find("[6/6]"), std::string::npos) << "progress lines: " << r.err;
  EXPECT_NE(r.err.find("ETA"), std::string::npos);
  EXPECT_NE(r.err.find("override run.seed = 3"), std::string::npos) << "overrides are echoed";
}

TEST(Sweep, AFailingPointBecomesARowAndTheSweepGoesOn) {
  TempDir tmp;
  fsu::write_file(tmp / "m.toml", kManifest);
  const auto r = run({tmp / "m.toml", "--out", tmp / "out", "--set", "run.fail_point=T16/B1/f0.5"});
  EXPECT_EQ(r.rc, 1) << "a failed point must make the exit code non-zero";
  const auto rows = rows_of(tmp / "out");
  ASSERT_EQ(rows.size(), 6u);
  int failed = 0;
  for (const auto& row : rows) {
    EXPECT_TRUE(ch::validate_row(row).empty()) << row.dump();
    if (row["status"] != "ok") {
      ++failed;
      EXPECT_EQ(row["status"], "error");
      EXPECT_EQ(row["point_id"], "tinyllama-debug/T16/B1/f0.5/loss_only/none");
      EXPECT_NE(row["error"].get<std::string>().find("injected failure"), std::string::npos);
    }
  }
  EXPECT_EQ(failed, 1);
  EXPECT_NE(r.err.find("5 ok, 1 failed"), std::string::npos) << r.err;
  // Resuming without the injected failure re-runs only the failed point.
  const auto again = run({tmp / "m.toml", "--out", tmp / "out", "--resume"});
  EXPECT_EQ(again.rc, 0) << again.err;
  const auto rows2 = rows_of(tmp / "out");
  ASSERT_EQ(rows2.size(), 7u);  // append-only: the error row stays, one ok row is added
  EXPECT_EQ(rows2.back()["point_id"], "tinyllama-debug/T16/B1/f0.5/loss_only/none");
  EXPECT_EQ(rows2.back()["status"], "ok");
}

TEST(Sweep, ResumeAfterATornLastLineGivesNoDuplicates) {
  TempDir tmp;
  fsu::write_file(tmp / "m.toml", kManifest);
  ASSERT_EQ(run({tmp / "m.toml", "--out", tmp / "out"}).rc, 0);
  // Simulate a kill in the middle of the fifth row: keep four rows and half of the fifth.
  const std::string path = tmp / "out/results.jsonl";
  const std::string text = fsu::read_file(path);
  size_t pos = 0;
  for (int i = 0; i < 4; ++i) pos = text.find('\n', pos) + 1;
  fsu::write_file(path, text.substr(0, pos + 40));
  // Without --resume the directory is refused (it holds rows), and nothing is appended.
  const auto refused = run({tmp / "m.toml", "--out", tmp / "out"});
  EXPECT_EQ(refused.rc, 1);
  EXPECT_NE(refused.err.find("--resume"), std::string::npos) << refused.err;
  const auto r = run({tmp / "m.toml", "--out", tmp / "out", "--resume"});
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("cut an incomplete last line"), std::string::npos) << r.err;
  const auto res = ch::read_results(path, false);
  EXPECT_EQ(res.torn_bytes, 0);
  EXPECT_EQ(res.bad_lines, 0);
  ASSERT_EQ(res.rows.size(), 6u);
  std::map<std::string, int> count;
  for (const auto& row : res.rows) ++count[row["point_id"].get<std::string>()];
  EXPECT_EQ(count.size(), 6u);
  for (const auto& [id, n] : count) EXPECT_EQ(n, 1) << id;
  // Running it once more does nothing.
  const auto noop = run({tmp / "m.toml", "--out", tmp / "out", "--resume"});
  EXPECT_EQ(noop.rc, 0);
  EXPECT_NE(noop.err.find("0 ok, 0 failed, 6 already ok"), std::string::npos) << noop.err;
  EXPECT_EQ(rows_of(tmp / "out").size(), 6u);
}

// A real interruption: SIGKILL the CLI while it writes rows, then resume.
TEST(Sweep, ResumeAfterAKilledProcessGivesNoDuplicates) {
  TempDir tmp;
  fsu::write_file(tmp / "m.toml", R"(
name = "killed"
[run]
device = "cpu"
warmup_steps = 0
measure_steps = 2
threads = 1
layer_timing = false
[axes]
model = "tinyllama-debug"
seq_len = [16, 24, 32, 40, 48, 56, 64, 72, 80, 88]
batch_size = [1, 2, 3]
method = "regular"
)");
  const std::string bin = std::string(COLLIDER_BINARY_DIR) + "/collider";
  ASSERT_TRUE(fsu::exists(bin)) << bin << " (build the collider_cli target)";
  const std::string out = tmp / "out", path = tmp / "out/results.jsonl";
  std::vector<std::string> argv_s = {bin, "run", tmp / "m.toml", "--out", out};
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 2, (tmp / "stderr.txt").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  pid_t pid = 0;
  ASSERT_EQ(posix_spawn(&pid, bin.c_str(), &fa, nullptr, argv.data(), environ), 0);
  posix_spawn_file_actions_destroy(&fa);
  // Kill it once two rows exist (or give up waiting after 60 s).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < deadline) {
    const std::string t = fsu::read_file(path);
    if (std::count(t.begin(), t.end(), '\n') >= 2) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ::kill(pid, SIGKILL);
  int status = 0;
  ::waitpid(pid, &status, 0);
  const auto before = ch::read_results(path, false);
  EXPECT_EQ(before.bad_lines, 0);
  EXPECT_GE(before.rows.size(), 2u);
  if (WIFSIGNALED(status)) { EXPECT_LT(before.rows.size(), 30u) << "killed before the end"; }

  const auto r = run({tmp / "m.toml", "--out", out, "--resume"});
  ASSERT_EQ(r.rc, 0) << r.err;
  const auto after = ch::read_results(path, false);
  ASSERT_EQ(after.rows.size(), 30u);
  std::set<std::string> ids;
  for (const auto& row : after.rows) {
    EXPECT_TRUE(ids.insert(row["point_id"].get<std::string>()).second) << "duplicate " << row["point_id"];
    EXPECT_EQ(row["status"], "ok");
  }
}

TEST(Sweep, CpuPeakMemoryGrowsWithTheBatch) {
  TempDir tmp;
  fsu::write_file(tmp / "m.toml", R"(
name = "mem"
[run]
device = "cpu"
warmup_steps = 0
measure_steps = 1
threads = 1
[axes]
model = "tinyllama-debug"
seq_len = 64
batch_size = [1, 8]
)");
  ASSERT_EQ(run({tmp / "m.toml", "--out", tmp / "out"}).rc, 0);
  const auto rows = rows_of(tmp / "out");
  ASSERT_EQ(rows.size(), 2u);
  const int64_t b1 = rows[0]["peak_mem_bytes"], b8 = rows[1]["peak_mem_bytes"];
  // Activations of B = 8 (logits alone: 8 x 64 x 256 floats = 512 KiB) on top of the same weights.
  EXPECT_GT(b8 - b1, 512 * 1024) << b1 << " vs " << b8;
}

// The caching CPU allocator under a small limit (8 MiB here, when this test installs it; ctest
// runs each test in its own process): blocks of many sizes freed past the limit push the least
// recently freed ones out, and every block handed out again holds what it is written, with the
// live-byte count exact throughout.
TEST(Sweep, CpuAllocatorCacheGivesBackTheOldestBlocksWhenFull) {
  ::setenv("COLLIDER_CPU_CACHE_MIB", "8", 1);
  collider::memory::install_cpu_memory_tracking();
  collider::memory::MemoryProbe probe(torch::kCPU);
  const int64_t base = probe.live_bytes();
  for (int round = 0; round < 3; ++round) {
    std::vector<torch::Tensor> held;
    int64_t bytes = 0;
    for (int64_t i = 1; i <= 12; ++i) {  // 0.25 .. 3 MiB, 19.5 MiB in all: past the limit
      held.push_back(torch::full({i * 65536}, static_cast<float>(round * 100 + i)));
      bytes += i * 65536 * 4;
    }
    EXPECT_EQ(probe.live_bytes() - base, bytes);
    for (int64_t i = 1; i <= 12; ++i) {
      EXPECT_EQ(held[i - 1].min().item<float>(), static_cast<float>(round * 100 + i));
      EXPECT_EQ(held[i - 1].max().item<float>(), static_cast<float>(round * 100 + i));
    }
    held.clear();
    EXPECT_EQ(probe.live_bytes() - base, 0);
  }
  ::unsetenv("COLLIDER_CPU_CACHE_MIB");
}

TEST(Sweep, ResumeWithoutOutPicksTheNewestRunOfTheManifest) {
  TempDir tmp;
  fsu::write_file(tmp / "m.toml", kManifest);
  char cwd[4096];
  ASSERT_NE(::getcwd(cwd, sizeof cwd), nullptr);
  ASSERT_EQ(::chdir(tmp.path.c_str()), 0);
  const auto none = run({"m.toml", "--resume"});
  EXPECT_EQ(none.rc, 2);
  EXPECT_NE(none.err.find("none found"), std::string::npos) << none.err;
  fsu::make_dirs("results/sweep-test/20000101-000000");
  const auto r = run({"m.toml", "--resume"});
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(rows_of("results/sweep-test/20000101-000000").size(), 6u);
  ASSERT_EQ(::chdir(cwd), 0);
}

// Every method, both attention gradients, through the CLI (needs Collider's rewriter).
TEST(Sweep, SmokeManifestRunsEveryMethod) {
  TempDir tmp;
  const std::string smoke = std::string(COLLIDER_SOURCE_DIR) + "/experiments/smoke.toml";
  const auto r = run({smoke, "--out", tmp / "out", "--set", "run.measure_steps=1", "--trace", tmp / "trace.json"});
  EXPECT_EQ(r.rc, 0) << r.err;
  const auto rows = rows_of(tmp / "out");
  ASSERT_EQ(rows.size(), 11u);
  for (const auto& row : rows) {
    EXPECT_EQ(row["status"], "ok") << row["point_id"] << ": " << row["error"];
    EXPECT_TRUE(ch::validate_row(row).empty()) << row["point_id"];
    if (row["method"] == "collider" && row["filter_ratio"] == 0.5) {
      EXPECT_LT(row["flops_bwd"].get<double>(), row["flops_bwd_dense"].get<double>()) << row["point_id"];
      EXPECT_GT(row["filter_stats"]["nodes_rewritten"].get<int64_t>(), 0);
      EXPECT_EQ(row["kept_per_seq"], 32);
    }
  }
  EXPECT_TRUE(fsu::exists(tmp / "trace.json"));
}

// run.floor: the T' floor is measured in its group's rounds and its row says which group; the
// group's table (harness/measure/table.h) sets Collider against regular, its ideal and the floor;
// run.copy_probe times a cold copy of the bytes Collider's rewrite cut.
TEST(Sweep, FloorPointsAreMeasuredInTheirGroupAndTabulated) {
  TempDir tmp;
  fsu::write_file(tmp / "m.toml", R"(
name = "floor-test"
[run]
device = "cpu"
warmup_steps = 1
measure_steps = 1
repetitions = 2
threads = 1
floor = true
copy_probe = true
[axes]
model = "tinyllama-debug"
seq_len = 32
filter_ratio = 0.5
method = ["regular", "collider"]
)");
  const auto r = run({tmp / "m.toml", "--out", tmp / "out"});
  ASSERT_EQ(r.rc, 0) << r.err;
  const auto rows = rows_of(tmp / "out");
  ASSERT_EQ(rows.size(), 3u);  // regular, collider kept_only, the floor at T' = 16
  const auto& floor = rows.back();
  EXPECT_EQ(floor["point_id"], "tinyllama-debug/T16/B1/f0/regular/none/floor");
  EXPECT_EQ(floor["seq_len"], 16);
  EXPECT_EQ(floor["floor_of"], 32);
  EXPECT_EQ(floor["group"], rows.front()["group"]);
  EXPECT_EQ(floor["group_points"], 3);
  EXPECT_TRUE(rows.front()["floor_of"].is_null());
  EXPECT_GT(rows[1]["copy_floor_ms"].get<double>(), 0.0) << "run.copy_probe: collider's cut bytes, copied cold";
  EXPECT_FALSE(rows.front().contains("copy_floor_ms"));
  for (const auto& row : rows) EXPECT_TRUE(ch::validate_row(row).empty()) << row["point_id"];
  // The figures, written once into the rows by the engine (measuring/figures.h) and printed by the
  // table; recomputed here from the rows' timings as the file holds them (rounded: 1e-3 relative).
  const double reg = rows[0]["bwd_ms"].get<double>();
  const double cost = rows[1]["bwd_ms"].get<double>() + rows[1]["rewrite_ms"].get<double>();
  auto near = [](double a, double b) { return std::abs(a - b) <= 1e-3 * std::max(std::abs(b), 1.0); };
  EXPECT_DOUBLE_EQ(rows[0]["reduction"].get<double>(), 0.0);
  EXPECT_TRUE(near(rows[1]["reduction"].get<double>(), 1.0 - cost / reg)) << rows[1]["reduction"];
  EXPECT_TRUE(near(rows[1]["vs_floor"].get<double>(), cost / floor["bwd_ms"].get<double>())) << rows[1]["vs_floor"];
  EXPECT_TRUE(near(rows[1]["of_ideal"].get<double>(),
                   rows[1]["reduction"].get<double>() / rows[1]["flop_ideal_bwd_reduction"].get<double>()));
  EXPECT_TRUE(rows[0]["vs_floor"].is_null() && rows[0]["of_ideal"].is_null());
  EXPECT_TRUE(near(rows[1]["step_reduction"].get<double>(),
                   1.0 - rows[1]["step_ms"].get<double>() / rows[0]["step_ms"].get<double>()));
  EXPECT_NE(r.err.find("floor (regular at T'=16)"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("vs floor"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(fmt::format("{:.2f}x", rows[1]["vs_floor"].get<double>())), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("collider kept_only@0.5"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("a plain cold copy of those bytes"), std::string::npos) << r.err;

  // collider figures: rows written without the figures get the engine's (from the file's rounded
  // timings), every other key unchanged.
  const std::string path = (tmp / "out") + "/results.jsonl";
  const std::vector<const char*> figures = {"reduction", "step_reduction", "of_ideal", "vs_floor"};
  auto without_figures = [&](nlohmann::json row) {
    for (const char* key : figures) row.erase(key);
    return row;
  };
  std::string stripped;
  for (const auto& row : rows) stripped += without_figures(row).dump() + "\n";
  fsu::write_file(path, stripped);
  std::ostringstream out;
  ASSERT_EQ(ch::run_figures_command({path}, out), 0);
  EXPECT_NE(out.str().find("1 groups, 3 rows"), std::string::npos) << out.str();
  const auto again = rows_of(tmp / "out");
  ASSERT_EQ(again.size(), rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    EXPECT_EQ(without_figures(again[i]), without_figures(rows[i])) << rows[i]["point_id"];
    for (const char* key : figures) {
      ASSERT_TRUE(again[i].contains(key)) << key;
      EXPECT_EQ(again[i][key].is_null(), rows[i][key].is_null()) << key;
      if (!rows[i][key].is_null()) EXPECT_TRUE(near(again[i][key].get<double>(), rows[i][key].get<double>())) << key;
    }
  }
  EXPECT_THROW(ch::run_figures_command({tmp / "missing.jsonl"}, out), std::invalid_argument);
}

// RHO-1's batch selection through Collider: batch_topk rows keep different counts; the row
// records them and counts the FLOP ideal on them, which is also what the rows execute.
TEST(Sweep, BatchTopKRunsColliderAndRecordsTheRowCounts) {
  TempDir tmp;
  fsu::write_file(tmp / "m.toml", kManifest);
  const auto r =
      run({tmp / "m.toml", "--out", tmp / "out", "--set", "run.selection=batch_topk", "--set",
           "axes.method=[\"loss_only\", \"collider\"]", "--set", "axes.batch_size=3", "--set", "axes.filter_ratio=0.5",
           "--set", "axes.seq_len=32", "--set", "axes.attention_grad=[\"kept_only\", \"exact_query\"]"});
  ASSERT_EQ(r.rc, 0) << r.err;
  const auto rows = rows_of(tmp / "out");
  ASSERT_GE(rows.size(), 3u);  // loss_only + collider x {kept_only, exact_query}
  for (const auto& row : rows) {
    ASSERT_EQ(row["status"], "ok") << row["error"];
    EXPECT_EQ(row["selection"], "batch_topk");
    const auto counts = row["kept_per_row"].get<std::vector<int64_t>>();
    ASSERT_EQ(counts.size(), 3u);
    int64_t sum = 0;
    for (auto n : counts) sum += n;
    EXPECT_EQ(sum, row["tokens_kept"].get<int64_t>());
    EXPECT_EQ(row["kept_per_row_max"].get<int64_t>(), *std::max_element(counts.begin(), counts.end()));
    if (row["method"] == "collider") {
      EXPECT_GT(row["flop_ideal_bwd_reduction"].get<double>(), 0.3) << row.dump();
      // the GEMMs run packed and the attention cores row by row: what executes is the FLOP count
      // on the actual counts
      EXPECT_DOUBLE_EQ(row["flops_bwd_executed"].get<double>(), row["flops_bwd"].get<double>());
      EXPECT_EQ(row["filter_stats"]["kept_total"].get<int64_t>(), sum);
    }
  }
}

// Real text (the shared sample) scored by excess loss against a reference model's losses, with
// batch_topk and per-sequence selection (align 1: the same total kept count) in the same rounds,
// and the T' floor on the same text: what bench_backward_ragged.toml measures at CPU scale.
TEST(Sweep, RealTextPutsRaggedAndPerSequenceSelectionInOneGroup) {
  TempDir tmp;
  const int status = collider::testing::prepare_sample_data(collider::testing::shared_sample_dir(), tmp / "prep.log");
  if (WIFEXITED(status) && WEXITSTATUS(status) == 3) GTEST_SKIP() << "no network and no cached .deb files";
  ASSERT_EQ(status, 0) << fsu::read_file(tmp / "prep.log");
  const std::string data = collider::testing::shared_sample_dir();
  {
    auto ref_model = collider::models::build_model(collider::models::preset("tinyllama-micro"),
                                                   collider::models::AttentionImpl::kEager, /*seed=*/7);
    ch::TokenShard shard(data + "/mix_train.bin");
    ch::compute_ref_losses(ref_model, shard, /*seq_len=*/16, /*num_windows=*/6, /*batch_size=*/6, tmp / "ref.f32");
  }
  const std::string manifest = R"(
name = "ragged-text"
[run]
device = "cpu"
warmup_steps = 0
measure_steps = 1
repetitions = 2
threads = 1
align = 1
score = "excess_loss"
floor = true
layer_timing = false
[axes]
model = "tinyllama-micro"
seq_len = 32
batch_size = 3
filter_ratio = 0.5
method = ["regular", "collider"]
attention_grad = "kept_only"
selection = ["per_sequence", "batch_topk"]
)";
  fsu::write_file(tmp / "m.toml", manifest);
  const auto r = run({tmp / "m.toml", "--out", tmp / "out", "--set", "run.data=\"" + data + "\"", "--set",
                      "run.reference_losses=\"" + std::string(tmp / "ref.f32") + "\""});
  ASSERT_EQ(r.rc, 0) << r.err;
  std::map<std::string, nlohmann::json> by_id;
  for (const auto& row : rows_of(tmp / "out")) by_id[row["point_id"].get<std::string>()] = row;
  const std::string base = "tinyllama-micro/T32/B3/f0.5/";
  ASSERT_EQ(by_id.size(), 4u);  // regular, collider per_sequence and batch_topk, the floor at T' = 16
  for (const auto& [id, row] : by_id) {
    EXPECT_EQ(row["status"], "ok") << id << ": " << row["error"];
    EXPECT_EQ(row["group"], "tinyllama-micro/T32/B3") << id;
  }
  const auto& per_seq = by_id.at(base + "collider/kept_only");
  const auto& ragged = by_id.at(base + "collider/kept_only/batch_topk");
  EXPECT_EQ(per_seq["selection"], "per_sequence");
  EXPECT_EQ(ragged["selection"], "batch_topk");
  EXPECT_EQ(ragged["score"], "excess_loss");
  EXPECT_EQ(per_seq["kept_per_row"], nlohmann::json({16, 16, 16}));
  EXPECT_EQ(ragged["tokens_kept"], per_seq["tokens_kept"]);  // the same total, spread differently
  EXPECT_NE(ragged["kept_per_row_min"], ragged["kept_per_row_max"]) << ragged["kept_per_row"];
  EXPECT_TRUE(by_id.count("tinyllama-micro/T16/B3/f0/regular/none/floor"));
  // The group's table sets the ragged point against the floor of the same total (T' = 16).
  const size_t at = r.err.find("\n  collider kept_only batch_topk@0.5") + 1;  // its line in the table
  ASSERT_NE(at, 0u) << r.err;
  const std::string line = r.err.substr(at, r.err.find('\n', at) - at);
  EXPECT_NE(line.find("x "), std::string::npos) << line;
}

// run.data, run.reference_losses and score excess_loss go together, and name files that exist.
TEST(Sweep, RealTextSettingsAreCheckedBeforeAnyCompute) {
  TempDir tmp;
  fsu::write_file(tmp / "m.toml", kManifest);
  auto r = run({tmp / "m.toml", "--out", tmp / "out", "--set", "run.score=excess_loss"});
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("run.data and run.reference_losses go together"), std::string::npos) << r.err;
  r = run({tmp / "m.toml", "--out", tmp / "out2", "--set", "run.score=excess_loss", "--set",
           "run.data=\"" + std::string(tmp / "none") + "\"", "--set", "run.reference_losses=\"x.f32\""});
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("mix_train.bin not found"), std::string::npos) << r.err;
}

// forward_drop rows (tinyllama-mini: 4 layers; the -debug presets have 2): flops_fwd and
// flops_bwd are its own formulas at the middle-layer count kept_count(T, ratio, align), the FLOP
// ideal is against regular's dense backward, every token's loss is kept, attention_grad "none";
// the schema refuses a forward_drop row without its middle-layer count.
TEST(Sweep, ForwardDropRowsCountTheMiddleLayersTokens) {
  TempDir tmp;
  fsu::write_file(tmp / "m.toml", R"(
name = "forward-drop-test"
[run]
device = "cpu"
warmup_steps = 0
measure_steps = 1
threads = 1
[axes]
model = "tinyllama-mini"
seq_len = 32
batch_size = 2
filter_ratio = 0.5
method = ["regular", "forward_drop"]
attention_grad = ["kept_only", "exact_query"]
)");
  const auto r = run({tmp / "m.toml", "--out", tmp / "out"});
  ASSERT_EQ(r.rc, 0) << r.err;
  const auto rows = rows_of(tmp / "out");
  ASSERT_EQ(rows.size(), 2u);
  const auto& cfg = collider::models::preset("tinyllama-mini");
  const int64_t N = 32 - 16;  // drop 0.5 x 32 = 16, a multiple of 8
  for (const auto& row : rows) {
    ASSERT_EQ(row["status"], "ok") << row["error"];
    const auto problems = ch::validate_row(row);
    EXPECT_TRUE(problems.empty()) << problems.front();
    EXPECT_EQ(row["attention_grad"], "none");
    EXPECT_EQ(row["tokens_kept"], 2 * 32);
    if (row["method"] != "forward_drop") {
      EXPECT_TRUE(row["middle_tokens_per_seq"].is_null());
      continue;
    }
    EXPECT_EQ(row["point_id"], "tinyllama-mini/T32/B2/f0.5/forward_drop/none");
    EXPECT_EQ(row["middle_tokens_per_seq"], N);
    const double fwd = collider::models::forward_drop_forward_flops(cfg, 2, 32, N).total();
    const double bwd = collider::models::forward_drop_backward_flops(cfg, 2, 32, N).total();
    const double dense = collider::models::backward_flops(cfg, 2, 32, 32, collider::models::MethodSpec{}).total();
    EXPECT_DOUBLE_EQ(row["flops_fwd"].get<double>(), fwd);
    EXPECT_DOUBLE_EQ(row["flops_bwd"].get<double>(), bwd);
    EXPECT_DOUBLE_EQ(row["flops_bwd_executed"].get<double>(), bwd);
    EXPECT_DOUBLE_EQ(row["flops_bwd_dense"].get<double>(), dense);
    EXPECT_DOUBLE_EQ(row["flop_ideal_bwd_reduction"].get<double>(), 1 - bwd / dense);
    EXPECT_GT(row["flop_ideal_bwd_reduction"].get<double>(), 0.0);
    auto broken = row;
    broken.erase("middle_tokens_per_seq");
    const auto p = ch::validate_row(broken);
    ASSERT_EQ(p.size(), 1u);
    EXPECT_NE(p[0].find("middle_tokens_per_seq"), std::string::npos) << p[0];
  }
}
