// Data preparation under concurrency (scripts/prepare_data.py): on a fresh machine several tests
// prepare the sample at once into one .deb cache. Three preparations start together into an empty
// cache (two of them into the same output directory): all succeed, the shared directory is
// prepared once (the second waits on its lock, then finds it complete), and every output equals a
// separate directory's byte for byte, with no temporary file left. And preparations killed with
// SIGKILL at seeded random moments never leave a half-written file under a final name; the next
// one completes the directory. Needs network or cached .debs (skips with the script's message).
//   build/tests/test_prepare_data
#include "base/fsutil.h"
#include "harness/components/token_data.h"
#include "process_test_util.h"
#include "temp_dir.h"

#include <dirent.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

namespace ct = collider::testing;
namespace fsu = collider::fsutil;

std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n != "." && n != "..") out.push_back(n);
    }
    ::closedir(d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::string> prepare_argv(const std::string& out) {
  return {"/bin/bash", std::string(COLLIDER_SOURCE_DIR) + "/scripts/prepare_data.sh", "--out", out, "--sample"};
}

// Files a finished preparation leaves (the lock file aside): no temporary names.
const std::vector<std::string> kOutputs = {
    "curated_eval.bin", "curated_eval.txt.sample", "curated_train.bin", "curated_train.txt.sample", "meta.json",
    "mix_eval.bin",     "mix_eval.txt.sample",     "mix_train.bin",     "mix_train.txt.sample",     "tokenizer.model",
    "tokenizer.vocab"};

// Every file under a final name is whole: shards parse with their token count, meta.json parses.
void expect_whole_files(const std::string& dir) {
  for (const auto& n : entries(dir)) {
    SCOPED_TRACE(dir + "/" + n);
    const std::string p = fsu::join(dir, n);
    if (n.size() > 4 && n.substr(n.size() - 4) == ".bin") {
      EXPECT_NO_THROW(collider::harness::TokenShard{p});
    } else if (n == "meta.json") {
      EXPECT_FALSE(nlohmann::json::parse(fsu::read_file(p), nullptr, false).is_discarded());
    } else if (n == "tokenizer.model") {
      EXPECT_NO_THROW(collider::harness::Tokenizer{p});
    }
  }
}

TEST(PrepareData, ThreePreparationsAtOnceIntoAnEmptyCacheAllSucceedWithIdenticalOutputs) {
  ct::TempDir t("prepare_race");
  const std::vector<std::string> env = {"COLLIDER_DEBS=" + t / "debs"};
  // a and b: the same output directory; c: another one. The cache t/debs starts empty.
  const std::vector<std::pair<std::string, std::string>> runs = {
      {t / "same", t / "a.log"}, {t / "same", t / "b.log"}, {t / "other", t / "c.log"}};
  std::vector<std::unique_ptr<ct::Child>> kids;
  for (const auto& [out, log] : runs)
    kids.push_back(std::make_unique<ct::Child>(prepare_argv(out), ct::ChildOptions{env, log}));
  std::vector<int> status;
  for (auto& k : kids) status.push_back(k->wait());
  // Exit status 3 means "cannot download the .deb files": skip only when a preparation alone
  // cannot either (no network); a download that failed only because of the race is a failure.
  for (size_t i = 0; i < runs.size(); ++i) {
    if (status[i] != 3) continue;
    if (ct::run_child(prepare_argv(t / "alone"), {{"COLLIDER_DEBS=" + t / "debs_alone"}, t / "alone.log"}) == 3) {
      GTEST_SKIP() << "no network and no cached .deb files:\n" << fsu::read_file(t / "alone.log");
    }
  }
  for (size_t i = 0; i < runs.size(); ++i) {
    EXPECT_EQ(status[i], 0) << runs[i].second << ":\n" << fsu::read_file(runs[i].second);
  }
  // The shared directory was prepared once: exactly one of a, b trained its tokenizer; the other
  // waited on the lock and found the data complete.
  const std::string la = fsu::read_file(t / "a.log"), lb = fsu::read_file(t / "b.log");
  const bool a_trained = la.find("tokenizer: trained") != std::string::npos;
  const bool b_trained = lb.find("tokenizer: trained") != std::string::npos;
  EXPECT_NE(a_trained, b_trained) << "a:\n" << la << "\nb:\n" << lb;
  EXPECT_NE((a_trained ? lb : la).find("exists: data ready"), std::string::npos);
  // Identical outputs, all present, nothing temporary left beside them.
  std::vector<std::string> want = kOutputs;
  want.insert(want.begin(), ".lock");
  EXPECT_EQ(entries(t / "same"), want);
  EXPECT_EQ(entries(t / "other"), want);
  for (const auto& n : kOutputs) {
    SCOPED_TRACE(n);
    const std::string x = fsu::read_file(fsu::join(t / "same", n)), y = fsu::read_file(fsu::join(t / "other", n));
    EXPECT_FALSE(x.empty());
    EXPECT_TRUE(x == y) << "differs between the two output directories";
  }
  expect_whole_files(t / "same");
  // The cache: five .deb files, five extracted trees, no download or extraction leftovers.
  int debs = 0;
  for (const auto& n : entries(t / "debs")) {
    EXPECT_TRUE(n == ".lock" || n == "extract" || n.find(".deb") != std::string::npos) << n;
    debs += n.size() > 4 && n.substr(n.size() - 4) == ".deb";
  }
  EXPECT_EQ(debs, 5);
  const auto trees = entries(t / "debs/extract");
  EXPECT_EQ(trees.size(), 5u);
  for (const auto& n : trees) {
    EXPECT_NE(n[0], '.') << "temporary tree left: " << n;
    EXPECT_TRUE(fsu::exists(fsu::join(fsu::join(t / "debs/extract", n), ".extracted"))) << n;
  }
}

TEST(PrepareData, AKilledPreparationLeavesNoHalfFileAndTheNextCompletesIt) {
  // Into the default .deb cache (shared with the other tests: its lock makes that safe).
  ct::TempDir t("prepare_kill");
  if (int st = ct::run_child(prepare_argv(t / "ref"), {{}, t / "ref.log"}); st != 0) {
    if (st == 3) GTEST_SKIP() << "no network and no cached .deb files:\n" << fsu::read_file(t / "ref.log");
    FAIL() << fsu::read_file(t / "ref.log");
  }
  std::mt19937 rng(17);
  std::uniform_int_distribution<int> ms(50, 1500);
  int killed_midway = 0;
  for (int round = 0; round < 3; ++round) {
    const int wait_ms = ms(rng);
    ct::Child c(prepare_argv(t / "k"), {{}, t / "k.log"});
    std::this_thread::sleep_for(std::chrono::milliseconds(wait_ms));
    killed_midway += c.kill9() == 128 + SIGKILL;
    // Whatever moment it died at, the files under final names are whole.
    SCOPED_TRACE("killed after " + std::to_string(wait_ms) + " ms");
    expect_whole_files(t / "k");
  }
  EXPECT_GT(killed_midway, 0) << "no kill landed before the preparation finished: the test shows nothing";
  ASSERT_EQ(ct::run_child(prepare_argv(t / "k"), {{}, t / "k.log"}), 0) << fsu::read_file(t / "k.log");
  for (const auto& n : kOutputs) {
    EXPECT_TRUE(fsu::read_file(fsu::join(t / "k", n)) == fsu::read_file(fsu::join(t / "ref", n))) << n;
  }
  std::vector<std::string> want = kOutputs;
  want.insert(want.begin(), ".lock");
  EXPECT_EQ(entries(t / "k"), want) << "temporary files left after the completing run";
}

}  // namespace
