// The run-directory lock (harness/run/run_lock.h) through `collider run`: two sweeps, and two training
// runs, started at once on one --out give exactly one set of rows and one clear refusal (naming the
// holder's pid, before any compute); a run killed with SIGKILL leaves its lock file behind but never
// blocks: --resume after it completes the rows with no duplicate. Plus the lock itself: a second
// holder is refused, a waiter gets it when the first releases it.
//   OMP_NUM_THREADS=1 build/tests/test_run_lock
#include "base/fsutil.h"
#include "harness/run/results.h"
#include "harness/run/run_lock.h"
#include "harness/components/token_data.h"
#include "process_test_util.h"
#include "temp_dir.h"
#include "utility_test_util.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <set>
#include <sstream>
#include <thread>

namespace {

namespace ch = collider::harness;
namespace ct = collider::testing;
namespace fsu = collider::fsutil;

bool contains(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }

TEST(RunLock, ASecondHolderIsRefusedWithThePidAndAWaiterGetsItOnRelease) {
  ct::TempDir t("run_lock");
  const std::string dir = t / "out";
  auto first = ch::RunDirLock::acquire(dir);
  ASSERT_TRUE(first.held());
  EXPECT_TRUE(contains(ch::run_dir_lock_holder(dir), fmt::format("pid {} ", ::getpid())));
  // flock locks belong to the open file: a second open in this process conflicts like another process.
  try {
    ch::RunDirLock::acquire(dir);
    FAIL() << "a second lock on the same directory was granted";
  } catch (const ch::RunDirBusy& e) {
    const std::string msg = e.what();
    EXPECT_TRUE(contains(msg, fmt::format("pid {} ", ::getpid()))) << msg;
    EXPECT_TRUE(contains(msg, "another --out directory")) << msg;
    EXPECT_TRUE(contains(msg, dir)) << msg;
  }
  // A waiter blocks until the holder releases.
  std::ostringstream log;
  const auto t0 = std::chrono::steady_clock::now();
  std::thread releaser([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    first.release();
  });
  auto second = ch::RunDirLock::acquire_waiting(dir, log, "test");
  const double waited_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  releaser.join();
  EXPECT_TRUE(second.held());
  EXPECT_GE(waited_ms, 250.0);
  EXPECT_TRUE(contains(log.str(), "waiting for")) << log.str();
  EXPECT_TRUE(contains(ch::run_dir_lock_holder(dir), "(test)"));
}

// A sweep of 20 points of a -debug model: a few seconds, so that two runs started together
// overlap even on a loaded machine (the second reaches the lock well within the first's run).
const char* kSweep = R"(
name = "lock-test"
[run]
device = "cpu"
warmup_steps = 0
measure_steps = 12
threads = 1
layer_timing = false
[axes]
model = "tinyllama-debug"
seq_len = [16, 24, 32, 40, 48, 56, 64, 72, 80, 88]
batch_size = [1, 2]
method = "regular"
)";
constexpr size_t kSweepPoints = 20;

std::vector<nlohmann::json> rows_of(const std::string& dir) {
  const auto r = ch::read_results(fsu::join(dir, "results.jsonl"), false);
  EXPECT_EQ(r.bad_lines, 0);
  EXPECT_EQ(r.torn_bytes, 0);
  return r.rows;
}

// Two runs of `argv` (each with `--out dir` appended) started at once: exactly one runs, the other
// is refused naming the winner's pid, and computes nothing. Returns the winner's log. The winner
// waits after taking the lock until the loser has been refused (COLLIDER_FAULT_HOLD, base/fault.h):
// without that, on a loaded machine the first run could finish before the second one started, and
// the second would be refused for the rows instead of the lock.
std::string expect_one_runs_and_one_is_refused(const ct::TempDir& t, std::vector<std::string> argv,
                                               const std::string& dir) {
  argv.push_back("--out");
  argv.push_back(dir);
  const std::string release = t / "release";
  const std::vector<std::string> env = {"COLLIDER_FAULT_HOLD=run_locked:" + release};
  ct::Child a(argv, {env, t / "a.log"}), b(argv, {env, t / "b.log"});
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(300);
  auto refused = [&](const char* log) { return contains(fsu::read_file(t / log), "is in use by another run"); };
  while (!refused("a.log") && !refused("b.log") && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  fsu::write_file(release, "");
  const int sa = a.wait(), sb = b.wait();
  const std::string la = fsu::read_file(t / "a.log"), lb = fsu::read_file(t / "b.log");
  EXPECT_TRUE((sa == 0) != (sb == 0)) << "exactly one run must succeed; status " << sa << " and " << sb << "\na:\n"
                                      << la << "\nb:\n"
                                      << lb;
  const bool a_won = sa == 0;
  const std::string& loser = a_won ? lb : la;
  const pid_t winner = a_won ? a.pid() : b.pid();
  EXPECT_TRUE(contains(loser, "is in use by another run")) << loser;
  EXPECT_TRUE(contains(loser, fmt::format("pid {} ", winner))) << "the refusal names the holder's pid:\n" << loser;
  EXPECT_TRUE(contains(loser, "another --out directory")) << loser;
  // Refused before any compute: no progress line, no reference stage.
  EXPECT_FALSE(contains(loser, "[1/")) << loser;
  EXPECT_FALSE(contains(loser, "reference:")) << loser;
  return a_won ? la : lb;
}

TEST(RunLock, TwoSweepsStartedAtOnceOnOneDirectoryGiveOneSetOfRowsAndOneRefusal) {
  ct::TempDir t("run_lock_sweep");
  fsu::write_file(t / "m.toml", kSweep);
  expect_one_runs_and_one_is_refused(t, {ct::collider_bin(), "run", t / "m.toml"}, t / "out");
  const auto rows = rows_of(t / "out");
  EXPECT_EQ(rows.size(), kSweepPoints);
  std::set<std::string> ids;
  for (const auto& r : rows) EXPECT_TRUE(ids.insert(r["point_id"].get<std::string>()).second) << r["point_id"];
}

TEST(RunLock, AStaleLockLeftByKill9NeverBlocksAndResumeCompletesTheRows) {
  ct::TempDir t("run_lock_stale");
  fsu::write_file(t / "m.toml", kSweep);
  const std::string out = t / "out", rows_path = t / "out/results.jsonl";
  ct::Child holder({ct::collider_bin(), "run", t / "m.toml", "--out", out}, {{}, t / "first.log"});
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (std::chrono::steady_clock::now() < deadline && ch::read_results(rows_path, false).rows.size() < 2) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(holder.kill9(), 128 + SIGKILL) << "the run ended before the kill:\n" << fsu::read_file(t / "first.log");
  const size_t before = rows_of(out).size();
  ASSERT_GE(before, 2u);
  ASSERT_LT(before, kSweepPoints);
  // The lock file stays with the dead holder's record, but the kernel released its flock.
  EXPECT_TRUE(contains(ch::run_dir_lock_holder(out), fmt::format("pid {} ", holder.pid())));
  // Without --resume the directory is refused for its rows (not for the lock); with it, it completes.
  ASSERT_NE(ct::run_child({ct::collider_bin(), "run", t / "m.toml", "--out", out}, {{}, t / "again.log"}), 0);
  const std::string again = fsu::read_file(t / "again.log");
  EXPECT_TRUE(contains(again, "--resume")) << again;
  EXPECT_FALSE(contains(again, "in use by another run")) << "a dead holder's lock blocked a run:\n" << again;
  ASSERT_EQ(ct::run_child({ct::collider_bin(), "run", t / "m.toml", "--out", out, "--resume"}, {{}, t / "resume.log"}),
            0)
      << fsu::read_file(t / "resume.log");
  const auto rows = rows_of(out);
  EXPECT_EQ(rows.size(), kSweepPoints);
  std::set<std::string> ids;
  for (const auto& r : rows) {
    EXPECT_TRUE(ids.insert(r["point_id"].get<std::string>()).second) << "duplicate " << r["point_id"];
    EXPECT_EQ(r["status"], "ok");
  }
}

TEST(RunLock, TwoTrainingRunsStartedAtOnceOnOneDirectoryGiveOneSetOfRowsAndOneRefusal) {
  ct::TempDir t("run_lock_train");
  const int st = ct::prepare_sample_data(ct::shared_sample_dir(), t / "prepare.log");
  if (WIFEXITED(st) && WEXITSTATUS(st) == 3) GTEST_SKIP() << "no network and no cached .deb files";
  ASSERT_EQ(st, 0) << fsu::read_file(t / "prepare.log");
  ASSERT_TRUE(ch::Tokenizer::available()) << "build without libsentencepiece-dev";
  const std::string bytes = ct::byte_level_data(ct::shared_sample_dir(), t / "bytes");
  fsu::write_file(t / "train.toml", fmt::format(R"(
name = "lock-train"
[data]
dir = "{}"
train = "mix_train"
reference = "curated_train"
eval = ["curated_eval"]
[train]
model = "tinyllama-debug"
seq_len = 32
batch_size = 2
steps = 8
eval_every = 4
eval_tokens = 256
eval_batch_size = 4
checkpoint_every = 4
log_every = 2
threads = 1
[reference]
steps = 4
batch_size = 2
[axes]
method = ["regular", "loss_only"]
filter_ratio = 0.5
)",
                                                bytes));
  expect_one_runs_and_one_is_refused(t, {ct::collider_bin(), "run", t / "train.toml"}, t / "out");
  // Two runs x (4 training-loss rows + 2 eval rows).
  const auto rows = rows_of(t / "out");
  EXPECT_EQ(rows.size(), 12u);
  std::set<std::string> keys;
  for (const auto& r : rows) {
    EXPECT_EQ(r["status"], "ok");
    EXPECT_TRUE(keys.insert(fmt::format("{}|{}|{}", r["point_id"].get<std::string>(), r["step"].get<int64_t>(),
                                        r["eval_set"].is_string() ? r["eval_set"].get<std::string>() : ""))
                    .second)
        << "duplicate row " << r.dump();
  }
}

}  // namespace
