// Failing writes (a full disk, a file size limit, a read-only or forbidden directory) end a run
// with a message naming the file and the errno text and a nonzero status; the rows written so far
// stay whole (a failed append is cut back, so no torn line), a checkpoint is never half-replaced,
// and --resume after freeing space completes the run with no duplicate row.
//   - the writers themselves under RLIMIT_FSIZE (in this process: EFBIG);
//   - `collider run` sweeps and training runs under a file size limit (ulimit -f; works unprivileged);
//   - a sweep on a small tmpfs that fills up (ENOSPC; needs mount, i.e. root: skipped otherwise)
//     whose space is then grown by a remount, and a run on a read-only mount (EROFS) or, without
//     root, a directory without write permission (EACCES).
//   OMP_NUM_THREADS=1 build/tests/test_write_failures
#include "base/fsutil.h"
#include "harness/run/results.h"
#include "harness/components/token_data.h"
#include "process_test_util.h"
#include "temp_dir.h"
#include "utility_test_util.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <set>

namespace {

namespace ch = collider::harness;
namespace ct = collider::testing;
namespace fsu = collider::fsutil;

bool contains(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }

int64_t file_size(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
}

// RLIMIT_FSIZE on this process for one scope (SIGXFSZ ignored, so write(2) returns EFBIG).
struct FileSizeLimit {
  explicit FileSizeLimit(rlim_t bytes) {
    ::getrlimit(RLIMIT_FSIZE, &saved_);
    old_handler_ = ::signal(SIGXFSZ, SIG_IGN);
    struct rlimit rl {
      bytes, saved_.rlim_max
    };
    ::setrlimit(RLIMIT_FSIZE, &rl);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &saved_);
    ::signal(SIGXFSZ, old_handler_);
  }
  struct rlimit saved_ {};
  sighandler_t old_handler_;
};

TEST(WriteFailures, AFailedRowAppendIsCutBackAndNamesTheFileAndErrno) {
  ct::TempDir t("write_fail_rows");
  const std::string path = t / "results.jsonl";
  ch::JsonlWriter w(path);
  nlohmann::json row = {{"point_id", "a"}, {"status", "ok"}, {"pad", std::string(3000, 'x')}};
  w.append(row);
  const int64_t one = file_size(path);
  ASSERT_GT(one, 3000);
  {
    // Room for half of the next row: the write is short, then fails; the half is cut back.
    FileSizeLimit limit(static_cast<rlim_t>(one + one / 2));
    try {
      w.append(row);
      FAIL() << "an append past the file size limit succeeded";
    } catch (const fsu::WriteError& e) {
      EXPECT_EQ(e.error_number, EFBIG);
      EXPECT_TRUE(contains(e.what(), path)) << e.what();
      EXPECT_TRUE(contains(e.what(), std::strerror(EFBIG))) << e.what();
    }
  }
  EXPECT_EQ(file_size(path), one) << "the partial row was not cut back";
  const auto r = ch::read_results(path, false);
  EXPECT_EQ(r.rows.size(), 1u);
  EXPECT_EQ(r.torn_bytes, 0);
  w.append(row);  // with space again, appending goes on cleanly
  EXPECT_EQ(ch::read_results(path, false).rows.size(), 2u);
}

TEST(WriteFailures, AFailedAtomicWriteLeavesTheOldFileAndNoTemporary) {
  ct::TempDir t("write_fail_atomic");
  const std::string path = t / "env.json";
  fsu::write_file_atomic(path, std::string("old\n"));
  {
    FileSizeLimit limit(1000);
    try {
      fsu::write_file_atomic(path, std::string(5000, 'n'));
      FAIL() << "a write past the file size limit succeeded";
    } catch (const fsu::WriteError& e) {
      EXPECT_EQ(e.error_number, EFBIG);
      EXPECT_TRUE(contains(e.what(), path)) << e.what();
      EXPECT_TRUE(contains(e.what(), std::strerror(EFBIG))) << e.what();
    }
  }
  EXPECT_EQ(fsu::read_file(path), "old\n");
  EXPECT_FALSE(fsu::exists(path + ".tmp." + std::to_string(::getpid())));
}

// A sweep of 16 points of a -debug model (rows of about 2.5 KB).
const char* kSweep = R"(
name = "full-disk"
[run]
device = "cpu"
warmup_steps = 0
measure_steps = 1
threads = 1
layer_timing = false
[axes]
model = "tinyllama-debug"
seq_len = [16, 24, 32, 40, 48, 56, 64, 72]
batch_size = [1, 2]
method = "regular"
)";
constexpr size_t kSweepPoints = 16;

// Rows of a directory: all parseable, no torn tail; returns them.
std::vector<nlohmann::json> whole_rows(const std::string& dir) {
  const auto r = ch::read_results(fsu::join(dir, "results.jsonl"), false);
  EXPECT_EQ(r.bad_lines, 0) << "unparseable line in " << dir;
  EXPECT_EQ(r.torn_bytes, 0) << "torn last line in " << dir;
  return r.rows;
}

void expect_all_points_once(const std::vector<nlohmann::json>& rows, size_t n) {
  EXPECT_EQ(rows.size(), n);
  std::set<std::string> ids;
  for (const auto& r : rows) {
    EXPECT_TRUE(ids.insert(r["point_id"].get<std::string>()).second) << "duplicate " << r["point_id"];
    EXPECT_EQ(r["status"], "ok");
  }
}

TEST(WriteFailures, ASweepPastAFileSizeLimitStopsNamingTheFileAndResumeCompletesIt) {
  ct::TempDir t("write_fail_sweep");
  fsu::write_file(t / "m.toml", kSweep);
  const std::string out = t / "out";
  ct::ChildOptions limited{{}, t / "limited.log", 12000};  // a few rows fit; the file size limit is per file
  const int st = ct::run_child({ct::collider_bin(), "run", t / "m.toml", "--out", out}, limited);
  const std::string log = fsu::read_file(t / "limited.log");
  EXPECT_NE(st, 0) << log;
  EXPECT_LT(st, 128) << "killed by a signal instead of ending with an error:\n" << log;
  EXPECT_TRUE(contains(log, out + "/results.jsonl")) << log;
  EXPECT_TRUE(contains(log, std::strerror(EFBIG))) << log;
  const auto partial = whole_rows(out);
  EXPECT_GE(partial.size(), 1u);
  EXPECT_LT(partial.size(), kSweepPoints);
  EXPECT_LE(file_size(out + "/results.jsonl"), 12000);
  // No limit ("space freed"): --resume runs the rest.
  ASSERT_EQ(ct::run_child({ct::collider_bin(), "run", t / "m.toml", "--out", out, "--resume"}, {{}, t / "resume.log"}),
            0)
      << fsu::read_file(t / "resume.log");
  expect_all_points_once(whole_rows(out), kSweepPoints);
}

TEST(WriteFailures, ATrainingCheckpointPastAFileSizeLimitStopsTheRunAndResumeFinishesIt) {
  ct::TempDir t("write_fail_train");
  const int pst = ct::prepare_sample_data(ct::shared_sample_dir(), t / "prepare.log");
  if (WIFEXITED(pst) && WEXITSTATUS(pst) == 3) GTEST_SKIP() << "no network and no cached .deb files";
  ASSERT_EQ(pst, 0) << fsu::read_file(t / "prepare.log");
  ASSERT_TRUE(ch::Tokenizer::available()) << "build without libsentencepiece-dev";
  const std::string bytes = ct::byte_level_data(ct::shared_sample_dir(), t / "bytes");
  fsu::write_file(t / "train.toml", fmt::format(R"(
name = "full-disk-train"
[data]
dir = "{}"
train = "mix_train"
reference = "curated_train"
eval = ["curated_eval"]
[train]
model = "tinyllama-debug"
seq_len = 32
batch_size = 2
steps = 6
eval_every = 3
eval_tokens = 256
eval_batch_size = 4
checkpoint_every = 2
log_every = 1
threads = 1
[reference]
steps = 2
batch_size = 2
[axes]
method = "loss_only"
filter_ratio = 0.5
)",
                                                bytes));
  // The reference stage (its files go to the data directory) first, without a limit.
  ASSERT_EQ(ct::run_child({ct::collider_bin(), "run", t / "train.toml", "--out", t / "warm"}, {{}, t / "warm.log"}), 0)
      << fsu::read_file(t / "warm.log");
  // The model file of a -debug checkpoint is far above 64 KB, the rows below it.
  const std::string out = t / "out";
  const int st =
      ct::run_child({ct::collider_bin(), "run", t / "train.toml", "--out", out}, {{}, t / "limited.log", 64 * 1024});
  const std::string log = fsu::read_file(t / "limited.log");
  EXPECT_NE(st, 0) << log;
  EXPECT_LT(st, 128) << log;
  EXPECT_TRUE(contains(log, ".safetensors")) << "the message names the checkpoint file:\n" << log;
  EXPECT_TRUE(contains(log, std::strerror(EFBIG))) << log;
  const auto partial = whole_rows(out);
  EXPECT_GE(partial.size(), 2u) << "the rows of steps 1 and 2 come before the first checkpoint";
  // No half checkpoint under the final name; the temporary one is dropped at resume.
  const std::string ckpt = out + "/checkpoints/tinyllama-debug_T32_B2_f0.5_loss_only_none";
  EXPECT_FALSE(fsu::exists(ckpt + "/trainer_state.json"));
  ASSERT_EQ(
      ct::run_child({ct::collider_bin(), "run", t / "train.toml", "--out", out, "--resume"}, {{}, t / "resume.log"}), 0)
      << fsu::read_file(t / "resume.log");
  const auto rows = whole_rows(out);
  const auto ref = whole_rows(t / "warm");
  ASSERT_EQ(rows.size(), ref.size()) << "6 training-loss rows + 2 eval rows";
  std::set<std::string> keys;
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& r = rows[i];
    EXPECT_TRUE(keys.insert(fmt::format("{}|{}", r["step"].get<int64_t>(), r["eval_set"].dump())).second) << r.dump();
  }
  // Same losses as the run that had space all along.
  for (size_t i = 0; i < rows.size(); ++i) {
    for (const char* k : {"train_loss", "val_loss"}) {
      if (ref[i].contains(k)) { EXPECT_EQ(rows[i].value(k, -1.0), ref[i][k].get<double>()) << k << " at row " << i; }
    }
  }
  EXPECT_FALSE(fsu::exists(out + "/checkpoints")) << "every run finished: no checkpoint left";
}

// A tmpfs mounted for one test (root only); unmounted on destruction.
struct TmpfsMount {
  std::string dir;
  bool mounted = false;
  std::string error;
  TmpfsMount(const std::string& where, const std::string& options, unsigned long flags = 0) : dir(where) {
    fsu::make_dirs(dir);
    if (::mount("tmpfs", dir.c_str(), "tmpfs", flags, options.c_str()) == 0) {
      mounted = true;
    } else {
      error = std::strerror(errno);
    }
  }
  bool remount(const std::string& options, unsigned long flags = 0) {
    return ::mount("tmpfs", dir.c_str(), "tmpfs", MS_REMOUNT | flags, options.c_str()) == 0;
  }
  ~TmpfsMount() {
    if (mounted) ::umount2(dir.c_str(), MNT_DETACH);
  }
};

TEST(WriteFailures, ASweepOnAFileSystemThatFillsUpStopsWithENOSPCAndResumeAfterFreeingSpaceCompletesIt) {
  ct::TempDir t("write_fail_enospc");
  fsu::write_file(t / "m.toml", kSweep);
  TmpfsMount disk(t / "disk", "size=32k");
  if (!disk.mounted) {
    GTEST_SKIP() << "cannot mount a small tmpfs here (" << disk.error
                 << "; needs root or CAP_SYS_ADMIN); the file size limit tests above cover the same paths";
  }
  const std::string out = disk.dir + "/out";
  const int st = ct::run_child({ct::collider_bin(), "run", t / "m.toml", "--out", out}, {{}, t / "full.log"});
  const std::string log = fsu::read_file(t / "full.log");
  EXPECT_NE(st, 0) << log;
  EXPECT_LT(st, 128) << log;
  EXPECT_TRUE(contains(log, std::strerror(ENOSPC))) << log;
  EXPECT_TRUE(contains(log, out + "/")) << "the message names the file:\n" << log;
  const auto partial = whole_rows(out);
  EXPECT_LT(partial.size(), kSweepPoints);
  // Free space (grow the file system), then resume.
  ASSERT_TRUE(disk.remount("size=4m")) << std::strerror(errno);
  ASSERT_EQ(ct::run_child({ct::collider_bin(), "run", t / "m.toml", "--out", out, "--resume"}, {{}, t / "resume.log"}),
            0)
      << fsu::read_file(t / "resume.log");
  expect_all_points_once(whole_rows(out), kSweepPoints);
}

TEST(WriteFailures, ARunOnAReadOnlyOrForbiddenDirectoryIsRefusedBeforeAnyCompute) {
  ct::TempDir t("write_fail_ro");
  fsu::write_file(t / "m.toml", kSweep);
  std::string out;
  int want_errno = 0;
  std::unique_ptr<TmpfsMount> ro;
  if (::geteuid() == 0) {
    // root ignores permission bits: a read-only mount gives EROFS.
    ro = std::make_unique<TmpfsMount>(t / "ro", "size=64k", MS_RDONLY);
    if (!ro->mounted) GTEST_SKIP() << "root, but cannot mount a read-only tmpfs (" << ro->error << ")";
    out = ro->dir + "/out";
    want_errno = EROFS;
  } else {
    fsu::make_dirs(t / "locked");
    ::chmod((t / "locked").c_str(), 0555);
    out = t / "locked/out";
    want_errno = EACCES;
  }
  const int st = ct::run_child({ct::collider_bin(), "run", t / "m.toml", "--out", out}, {{}, t / "ro.log"});
  const std::string log = fsu::read_file(t / "ro.log");
  EXPECT_NE(st, 0) << log;
  EXPECT_LT(st, 128) << log;
  EXPECT_TRUE(contains(log, std::strerror(want_errno))) << log;
  EXPECT_TRUE(contains(log, out)) << log;
  EXPECT_FALSE(contains(log, "[1/")) << "refused before any compute:\n" << log;
  if (::geteuid() != 0) ::chmod((t / "locked").c_str(), 0755);
}

}  // namespace
