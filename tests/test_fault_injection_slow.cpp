// Fault injection (label slow): `collider run` killed with SIGKILL at 20 seeded random moments in
// all, each kill followed by --resume, until the run completes:
//   - a timing sweep of a -debug model: kills at random times and half-way through a row append
//     (COLLIDER_FAULT_AT=row_append, base/fault.h: leaves a torn last line for resume to cut);
//   - a training run (reference stage, checkpoints every 2 steps): kills at random times, half-way
//     through a checkpoint file (checkpoint_write), between the checkpoint renames
//     (checkpoint_swap) and half-way through a row.
// At the end the rows are exactly the expected set (sweep: one per point; training: one per
// (step, eval set)), no duplicate, no torn or unparseable line, and every loss of the training
// run (each logged training loss and each evaluation, the final one included) is bit-equal to an
// uninterrupted run with the same seed. Prints the counts: kills, resumes, rows checked,
// duplicates found, torn lines cut.
//   OMP_NUM_THREADS=1 build/tests/test_fault_injection_slow   (about 2-4 minutes on 2 cores)
#include "base/fsutil.h"
#include "harness/run/results.h"
#include "harness/components/token_data.h"
#include "process_test_util.h"
#include "temp_dir.h"
#include "utility_test_util.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <thread>

namespace {

namespace ch = collider::harness;
namespace ct = collider::testing;
namespace fsu = collider::fsutil;

using Clock = std::chrono::steady_clock;

struct Counts {
  int kills = 0;      // runs that died of SIGKILL
  int resumes = 0;    // runs started with --resume
  int completed = 0;  // runs that reached the end before their kill
  int torn_cut = 0;   // torn last lines cut by a resume
  int rows_checked = 0;
  int duplicates = 0;
};

// How a run is interrupted: a timed SIGKILL (once `rows_ahead` more rows are in the results file
// than at the start, then after `after_ms`: a random moment in the run's remaining work, so that
// the kills spread over the whole run instead of all landing in start-up), or at the n-th hit of
// a fault point inside the process.
struct Fault {
  std::string point;  // empty: a timed kill
  int nth = 0;
  int rows_ahead = 0;
  int after_ms = 0;
  std::string describe() const {
    return point.empty() ? fmt::format("SIGKILL {} ms after {} more rows", after_ms, rows_ahead)
                         : fmt::format("COLLIDER_FAULT_AT={}:{}", point, nth);
  }
};

int64_t count_lines(const std::string& path) {
  const std::string t = fsu::read_file(path);
  return std::count(t.begin(), t.end(), '\n');
}

// Runs `argv` (writing DIR/results.jsonl) until it ends or the fault kills it (counted in `c`).
void run_with_fault(const std::vector<std::string>& argv, const std::string& rows_path, const Fault& f,
                    const std::string& log, Counts& c) {
  ct::ChildOptions o{{}, log};
  if (!f.point.empty()) o.env.push_back(fmt::format("COLLIDER_FAULT_AT={}:{}", f.point, f.nth));
  fsu::write_file(log + ".fault", f.describe() + "\n");
  const int64_t lines_at_start = count_lines(rows_path);
  ct::Child child(argv, o);
  int status = -1;
  if (f.point.empty()) {
    bool ended = false;
    while (!(ended = child.done(&status)) && count_lines(rows_path) < lines_at_start + f.rows_ahead) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    const auto deadline = Clock::now() + std::chrono::milliseconds(f.after_ms);
    while (!ended && Clock::now() < deadline && !(ended = child.done(&status))) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    status = child.kill9();
  } else {
    status = child.wait();
  }
  const std::string text = fsu::read_file(log);
  if (text.find("cut an incomplete last line") != std::string::npos) ++c.torn_cut;
  if (status == 128 + SIGKILL) {
    ++c.kills;
    return;
  }
  EXPECT_EQ(status, 0) << f.describe() << ":\n" << text;
  ++c.completed;
}

// Kills `argv` at each fault in turn (resuming after each), then resumes it to completion.
void kill_and_resume(std::vector<std::string> argv, const std::string& rows_path, const std::vector<Fault>& faults,
                     const std::string& logs, Counts& c) {
  bool resume = false;
  int i = 0;
  for (const auto& f : faults) {
    auto a = argv;
    if (resume) {
      a.push_back("--resume");
      ++c.resumes;
    }
    run_with_fault(a, rows_path, f, fmt::format("{}.{:02d}.log", logs, i++), c);
    resume = true;  // every later run continues this directory, killed or not
  }
  argv.push_back("--resume");
  ++c.resumes;
  const std::string last = fmt::format("{}.final.log", logs);
  ASSERT_EQ(ct::run_child(argv, {{}, last}), 0) << fsu::read_file(last);
  if (fsu::read_file(last).find("cut an incomplete last line") != std::string::npos) ++c.torn_cut;
}

// Rows of DIR: every line parses, no torn tail.
std::vector<nlohmann::json> whole_rows(const std::string& dir) {
  const auto r = ch::read_results(fsu::join(dir, "results.jsonl"), false);
  EXPECT_EQ(r.bad_lines, 0) << "unparseable lines in " << dir;
  EXPECT_EQ(r.torn_bytes, 0) << "torn last line in " << dir;
  return r.rows;
}

std::string row_key(const nlohmann::json& r) {
  return fmt::format("{}|{}|{}", r["point_id"].get<std::string>(), r.value("step", int64_t{-1}),
                     r.contains("eval_set") && r["eval_set"].is_string() ? r["eval_set"].get<std::string>() : "");
}

void print_counts(const char* what, const Counts& c) {
  const std::string line = fmt::format(
      "[fault injection] {}: kills {}, resumes {}, runs that finished before their kill {}, torn lines cut {}, rows "
      "checked {}, duplicates found {}",
      what, c.kills, c.resumes, c.completed, c.torn_cut, c.rows_checked, c.duplicates);
  std::cout << line << std::endl;
  ::testing::Test::RecordProperty(std::string(what) + "_kills", c.kills);
  ::testing::Test::RecordProperty(std::string(what) + "_duplicates", c.duplicates);
}

// 24 points of about 0.1-0.3 s each on a -debug model.
const char* kSweep = R"(
name = "fault-sweep"
[run]
device = "cpu"
warmup_steps = 0
measure_steps = 10
threads = 1
layer_timing = false
[axes]
model = "tinyllama-debug"
seq_len = [16, 32, 48, 64, 80, 96]
batch_size = [1, 2]
method = ["regular", "collider"]
filter_ratio = 0.5
attention_grad = "exact_query"
)";

TEST(FaultInjection, ASweepKilledTenTimesEndsWithExactlyOneRowPerPoint) {
  ct::TempDir t("fault_sweep");
  fsu::write_file(t / "m.toml", kSweep);
  // The expected points, from the manifest itself.
  ct::ChildOptions dry{{}, t / "dry.log"};
  ASSERT_EQ(ct::run_child({ct::collider_bin(), "run", t / "m.toml", "--dry-run"}, dry), 0);
  std::set<std::string> points;
  {
    std::istringstream in(fsu::read_file(t / "dry.log"));
    std::string line;
    while (std::getline(in, line)) {
      const auto p = line.find("tinyllama-debug/");
      if (p != std::string::npos) points.insert(line.substr(p));
    }
  }
  ASSERT_EQ(points.size(), 24u);
  // Timed kills: 0-1 rows ahead, then 0-400 ms (start-up, or inside a point); every third kill
  // half-way through a row append (the 1st-3rd of that run).
  std::mt19937 rng(20261201);
  std::uniform_int_distribution<int> rows_ahead(0, 1), after_ms(0, 400), nth(1, 3);
  std::vector<Fault> faults;
  for (int i = 0; i < 10; ++i) {
    if (i % 3 == 2) {
      faults.push_back({"row_append", nth(rng), 0, 0});
    } else {
      const int r = rows_ahead(rng);
      faults.push_back({"", 0, r, after_ms(rng)});
    }
  }
  Counts c;
  kill_and_resume({ct::collider_bin(), "run", t / "m.toml", "--out", t / "out"}, t / "out/results.jsonl", faults,
                  t / "run", c);
  const auto rows = whole_rows(t / "out");
  std::set<std::string> seen;
  for (const auto& r : rows) {
    ++c.rows_checked;
    EXPECT_TRUE(ch::validate_row(r).empty()) << r.dump();
    if (!seen.insert(r["point_id"].get<std::string>()).second) ++c.duplicates;
    EXPECT_EQ(r["status"], "ok");
  }
  print_counts("sweep", c);
  EXPECT_EQ(seen, points);
  EXPECT_EQ(c.duplicates, 0);
  EXPECT_EQ(rows.size(), points.size());
  EXPECT_GE(c.kills, 9) << "the kills must land inside the run for the test to mean something";
  EXPECT_GE(c.torn_cut, 1) << "a kill half-way through a row must leave a torn line for resume to cut";
}

std::string train_manifest(const std::string& data_dir) {
  return fmt::format(R"(
name = "fault-train"
[data]
dir = "{}"
train = "mix_train"
reference = "curated_train"
eval = ["curated_eval", "mix_eval"]
[train]
model = "tinyllama-debug"
seq_len = 32
batch_size = 2
steps = 40
warmup_steps = 2
eval_every = 5
eval_tokens = 256
eval_batch_size = 4
checkpoint_every = 2
log_every = 3
threads = 1
[reference]
steps = 6
batch_size = 2
[axes]
method = "collider"
attention_grad = "exact_query"
filter_ratio = 0.5
)",
                     data_dir);
}

TEST(FaultInjection, ATrainingRunKilledTenTimesResumesToTheUninterruptedLosses) {
  ct::TempDir t("fault_train");
  const int pst = ct::prepare_sample_data(ct::shared_sample_dir(), t / "prepare.log");
  if (WIFEXITED(pst) && WEXITSTATUS(pst) == 3) GTEST_SKIP() << "no network and no cached .deb files";
  ASSERT_EQ(pst, 0) << fsu::read_file(t / "prepare.log");
  ASSERT_TRUE(ch::Tokenizer::available()) << "build without libsentencepiece-dev";
  // Two copies of the data, so that the killed run computes its own reference stage (under kills
  // too) and the uninterrupted run its own.
  fsu::write_file(t / "whole.toml", train_manifest(ct::byte_level_data(ct::shared_sample_dir(), t / "data_whole")));
  fsu::write_file(t / "killed.toml", train_manifest(ct::byte_level_data(ct::shared_sample_dir(), t / "data_killed")));
  const auto t0 = Clock::now();
  ASSERT_EQ(ct::run_child({ct::collider_bin(), "run", t / "whole.toml", "--out", t / "whole"}, {{}, t / "whole.log"}),
            0)
      << fsu::read_file(t / "whole.log");
  const int whole_ms = static_cast<int>(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  // Steps 2, 4, ..., 38 checkpoint (4 files each; the reference stage's too); rows come every 3rd
  // step (training loss) and every 5th (two evaluations). Timed kills: 0-2 rows ahead, then a
  // random part of an eighth of the uninterrupted run; fault points: the 1st-6th hit in that run
  // (a checkpoint is 4 files: config.json, model and optimizer safetensors, trainer_state.json).
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> rows_ahead(0, 2), after_ms(0, std::max(200, whole_ms / 8)), nth(1, 6);
  std::vector<Fault> faults;
  const char* points[] = {"", "checkpoint_write", "", "checkpoint_swap", "", "checkpoint_write", "row_append",
                          "", "checkpoint_write", ""};
  for (const char* p : points) {
    if (*p) {
      faults.push_back({p, nth(rng), 0, 0});
    } else {
      const int r = rows_ahead(rng);
      faults.push_back({"", 0, r, after_ms(rng)});
    }
  }
  Counts c;
  kill_and_resume({ct::collider_bin(), "run", t / "killed.toml", "--out", t / "killed"}, t / "killed/results.jsonl",
                  faults, t / "run", c);

  const auto whole = whole_rows(t / "whole"), killed = whole_rows(t / "killed");
  std::map<std::string, nlohmann::json> want, got;
  for (const auto& r : whole) want[row_key(r)] = r;
  for (const auto& r : killed) {
    ++c.rows_checked;
    EXPECT_EQ(r["status"], "ok") << r.dump();
    if (!got.emplace(row_key(r), r).second) ++c.duplicates;
  }
  print_counts("training", c);
  std::cout << fmt::format("[fault injection] training: uninterrupted run {} ms, {} rows", whole_ms, whole.size())
            << std::endl;
  EXPECT_EQ(c.duplicates, 0);
  EXPECT_EQ(killed.size(), whole.size());
  ASSERT_EQ(got.size(), want.size());
  // Bit-equal losses (JSON keeps every double exactly): same seed, same windows, the AdamW state
  // and the partial training-loss sums restored from the checkpoint.
  int finals = 0;
  for (const auto& [key, w] : want) {
    ASSERT_TRUE(got.count(key)) << "missing row " << key;
    const auto& g = got[key];
    for (const char* k : {"train_loss", "train_loss_kept", "val_loss", "tokens_backprop"}) {
      if (w.contains(k)) { EXPECT_EQ(g[k].get<double>(), w[k].get<double>()) << key << " " << k; }
    }
    EXPECT_EQ(g["final"], w["final"]) << key;
    finals += w["final"].get<bool>();
  }
  EXPECT_EQ(finals, 2) << "one final row per eval set";
  EXPECT_EQ(want.size(), 30u) << "14 training-loss rows + 8 evaluations x 2 eval sets";
  EXPECT_GE(c.kills, 9) << "the kills must land inside the run for the test to mean something";
  EXPECT_GE(c.torn_cut, 1) << "the kill half-way through a row must leave a torn line for resume to cut";
  EXPECT_FALSE(fsu::exists(t / "killed/checkpoints")) << "the finished run leaves no checkpoint behind";
}

}  // namespace
