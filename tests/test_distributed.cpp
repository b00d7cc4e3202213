// Data parallelism on c10d Gloo over loopback (harness/components/distributed.h), label `distributed`:
//  - 2 ranks x B=1 for 5 steps (tests/distributed_worker, one process per rank) end with the
//    parameters, losses and clipped grad norms of one process on the concatenated B=2 batch,
//    for loss_only and collider, and also with 1 + 2 rows (unequal kept counts: weighted
//    reduction, and 64 KiB buckets overlapping the backward); the checkpoint rank 0 wrote loads
//    into a single-process model;
//  - a rank that exits early or hangs makes the other exit non-zero (status 3) with a message
//    naming its rank, well before the test's 30 s limit;
//  - `collider run` under scripts/launch.sh: rank 0 writes one row per point with world_size 2;
//    a failing point ends the run on every rank (status 3);
//  - launch variables are validated.
// Run: OMP_NUM_THREADS=1 build/tests/test_distributed   (spawns build/tests/distributed_worker)
#include "distributed_test_util.h"
#include "temp_dir.h"

#include "base/fsutil.h"
#include "models/checkpoint.h"

#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace ch = collider::harness;
namespace ct = collider::testing;

namespace {

// A port the kernel considers free right now (bound to 0, read back, released).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    if (fd >= 0) ::close(fd);
    return 29500 + static_cast<int>(::getpid() % 1000);
  }
  const int port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

struct Rank {
  pid_t pid = -1;
  std::string log;  // stdout + stderr of the process
  int status = -1;  // exit status; -1 while running or when killed
};

// Starts tests/distributed_worker as rank `rank` of `world` with the extra arguments.
Rank spawn_rank(int rank, int world, int port, const std::vector<std::string>& args, const std::string& log,
                int timeout_s = 20) {
  std::vector<std::string> env_kv;
  auto is_launch_var = [](const std::string& kv) {
    for (const char* k : {"RANK=", "WORLD_SIZE=", "LOCAL_RANK=", "MASTER_ADDR=", "MASTER_PORT=",
                          "COLLIDER_DIST_TIMEOUT_S=", "OMP_NUM_THREADS="}) {
      if (kv.rfind(k, 0) == 0) return true;
    }
    return false;
  };
  for (char** e = environ; *e != nullptr; ++e) {
    if (!is_launch_var(*e)) env_kv.emplace_back(*e);
  }
  env_kv.push_back("RANK=" + std::to_string(rank));
  env_kv.push_back("LOCAL_RANK=" + std::to_string(rank));
  env_kv.push_back("WORLD_SIZE=" + std::to_string(world));
  env_kv.push_back("MASTER_ADDR=127.0.0.1");
  env_kv.push_back("MASTER_PORT=" + std::to_string(port));
  env_kv.push_back("COLLIDER_DIST_TIMEOUT_S=" + std::to_string(timeout_s));
  env_kv.push_back("OMP_NUM_THREADS=1");
  std::vector<std::string> argv_s = {COLLIDER_DIST_WORKER};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv, envp;
  for (auto& s : argv_s) argv.push_back(s.data());
  argv.push_back(nullptr);
  for (auto& s : env_kv) envp.push_back(s.data());
  envp.push_back(nullptr);

  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  Rank r;
  r.log = log;
  const int rc = posix_spawn(&r.pid, argv[0], &fa, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) r.pid = -1;
  return r;
}

// Waits for every rank until `deadline_s` from now; ranks still running then are killed
// (status stays -1). Returns the seconds waited.
double wait_ranks(std::vector<Rank>& ranks, double deadline_s) {
  const auto t0 = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  size_t left = ranks.size();
  while (left > 0 && elapsed() < deadline_s) {
    for (auto& r : ranks) {
      if (r.pid <= 0) continue;
      int st = 0;
      if (::waitpid(r.pid, &st, WNOHANG) == r.pid) {
        r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        r.pid = -1;
        --left;
      }
    }
    if (left > 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  for (auto& r : ranks) {
    if (r.pid > 0) {
      ::kill(r.pid, SIGKILL);
      ::waitpid(r.pid, nullptr, 0);
      r.pid = -1;
    }
  }
  return elapsed();
}

std::string read_log(const Rank& r) {
  return collider::fsutil::exists(r.log) ? collider::fsutil::read_file(r.log) : std::string("(no log)");
}

struct DpCase {
  std::string method;
  std::vector<int64_t> rows;  // batch rows per rank; unequal rows = unequal kept counts
  int64_t bucket_kib;         // 25600 (one bucket for the debug model) or small: many, started during backward
};

class DataParallel : public ::testing::TestWithParam<DpCase> {};

TEST_P(DataParallel, TwoRanksEqualOneProcessOnTheConcatenatedBatch) {
  if (!ch::distributed_available()) GTEST_SKIP() << "built without COLLIDER_DISTRIBUTED (libgloo-dev missing)";
  const std::string method = GetParam().method;
  const std::vector<int64_t> rows = GetParam().rows;
  const std::string rows_arg = std::to_string(rows[0]) + "," + std::to_string(rows[1]);
  const int kSteps = 5;
  ct::TempDir dir("dist_" + method);
  const std::string ckpt = dir / "ckpt";
  const int port = free_port();
  std::vector<Rank> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.push_back(spawn_rank(r, 2, port,
                               {"--method", method, "--steps", std::to_string(kSteps), "--rows", rows_arg, "--out",
                                ckpt, "--bucket-kib", std::to_string(GetParam().bucket_kib)},
                               dir / ("rank" + std::to_string(r) + ".log")));
    ASSERT_GT(ranks.back().pid, 0) << "could not start " << COLLIDER_DIST_WORKER;
  }

  // Meanwhile, the reference: one process, no reducer, all rows of every step's batch.
  at::set_num_threads(1);
  ch::Trainer single = ct::make_dist_trainer(method);
  const nlohmann::json ref_log = ct::run_dist_steps(single, kSteps, {rows[0] + rows[1]}, /*rank=*/0);

  wait_ranks(ranks, 120);
  for (int r = 0; r < 2; ++r) { ASSERT_EQ(ranks[r].status, 0) << "rank " << r << ":\n" << read_log(ranks[r]); }

  // Rank 0's checkpoint, loaded by a process of another world size (this one, world 1).
  auto loaded = collider::models::build_model(collider::models::preset(ct::kDistPreset),
                                              collider::models::AttentionImpl::kEager, /*seed=*/999);
  const auto state = collider::models::load_training_checkpoint(ckpt, loaded);
  EXPECT_EQ(state.trainer_state.at("world_size").get<int>(), 2);
  EXPECT_FALSE(state.optimizer_state.empty());

  const auto ref = collider::models::parameter_tensors(*single.model());
  const auto got = collider::models::parameter_tensors(*loaded);
  ASSERT_EQ(ref.size(), got.size());
  double max_diff = 0.0, max_moved = 0.0;
  const auto init = collider::models::parameter_tensors(*collider::models::build_model(
      collider::models::preset(ct::kDistPreset), collider::models::AttentionImpl::kEager, ct::kDistSeed));
  for (const auto& [name, p] : ref) {
    ASSERT_TRUE(got.count(name)) << name;
    max_diff = std::max(max_diff, (p - got.at(name)).abs().max().item<double>());
    max_moved = std::max(max_moved, (p - init.at(name)).abs().max().item<double>());
  }
  std::cout << method << " rows " << rows_arg << ": max |2 ranks - 1 process| = " << max_diff
            << " over parameters that moved up to " << max_moved << " in " << kSteps << " steps\n";
  EXPECT_GT(max_moved, 1e-3) << "the 5 steps should move the parameters";
  // fp32 tolerance after 5 AdamW steps: 1% of the largest parameter change (AdamW normalises every
  // element's step, so rounding in a near-zero gradient element moves it by up to lr; measured
  // 1e-7 to 1e-5 here). Not reducing at all differs by ~lr = 1e-3.
  EXPECT_LT(max_diff, 1e-2 * max_moved) << method << ": 2-rank parameters differ from the single-process run";

  // Losses, clipped grad norms and kept counts agree step by step (rank 0's log, over both ranks).
  const auto& dist_log = state.trainer_state.at("steps");
  ASSERT_EQ(dist_log.size(), ref_log.size());
  for (size_t s = 0; s < ref_log.size(); ++s) {
    EXPECT_NEAR(dist_log[s]["loss"].get<double>(), ref_log[s]["loss"].get<double>(), 1e-5) << "step " << s;
    EXPECT_NEAR(dist_log[s]["grad_norm"].get<double>(), ref_log[s]["grad_norm"].get<double>(),
                1e-4 * ref_log[s]["grad_norm"].get<double>())
        << "step " << s << ": clipping must see the reduced gradients";
    EXPECT_GT(ref_log[s]["grad_norm"].get<double>(), ct::dist_step_config(method).grad_clip) << "clipping is active";
    EXPECT_EQ(dist_log[s]["tokens_kept"].get<int64_t>(), ref_log[s]["tokens_kept"].get<int64_t>()) << "step " << s;
    const auto per_rank = dist_log[s]["rank_tokens_kept"].get<std::vector<int64_t>>();
    ASSERT_EQ(per_rank.size(), 2u);
    EXPECT_EQ(per_rank[0] + per_rank[1], ref_log[s]["tokens_kept"].get<int64_t>());
    EXPECT_EQ(per_rank[0], rows[0] * ct::kDistT / 2) << "filter_ratio 0.5 keeps half of each row";
    EXPECT_EQ(per_rank[1], rows[1] * ct::kDistT / 2);
    if (GetParam().bucket_kib < 1024) {
      // Small buckets: several, and all but the last started from the hooks while backward ran.
      EXPECT_GT(dist_log[s]["buckets"].get<int64_t>(), 2);
      EXPECT_GE(dist_log[s]["buckets_overlapped"].get<int64_t>(), dist_log[s]["buckets"].get<int64_t>() - 1);
    }
  }
}

// 1,2 rows: rank 1 keeps twice rank 0's tokens, so the reducer must weight by kept count (not
// average); 64 KiB buckets: many all-reduces started from the gradient hooks during backward.
INSTANTIATE_TEST_SUITE_P(Methods, DataParallel,
                         ::testing::Values(DpCase{"loss_only", {1, 1}, 25600}, DpCase{"collider", {1, 1}, 25600},
                                           DpCase{"loss_only", {1, 2}, 64}, DpCase{"collider", {1, 2}, 64}),
                         [](const auto& info) {
                           return info.param.method + "_rows" + std::to_string(info.param.rows[0]) + "_" +
                                  std::to_string(info.param.rows[1]) + "_bucket" +
                                  std::to_string(info.param.bucket_kib) + "k";
                         });

// One rank leaves (exits 0 after 1 step) or hangs; the other must fail fast with its rank in the message.
void expect_peer_failure(const std::string& mode, int timeout_s, double limit_s) {
  ct::TempDir dir("dist_fail_" + mode);
  const int port = free_port();
  std::vector<Rank> ranks;
  ranks.push_back(spawn_rank(0, 2, port, {"--steps", "20"}, dir / "rank0.log", timeout_s));
  ranks.push_back(spawn_rank(1, 2, port, {"--steps", "20", mode, "1"}, dir / "rank1.log", timeout_s));
  std::vector<Rank> first = {ranks[0]};
  const double waited = wait_ranks(first, limit_s);
  const std::string log0 = read_log(first[0]);
  std::vector<Rank> second = {ranks[1]};
  wait_ranks(second, mode == "--hang-after" ? 0.0 : 10.0);  // a hung rank is killed here
  EXPECT_EQ(first[0].status, 3) << "rank 0 must exit with status 3 (distributed failure), log:\n" << log0;
  EXPECT_LT(waited, limit_s);
  EXPECT_NE(log0.find("rank 0 of 2"), std::string::npos) << log0;
  EXPECT_NE(log0.find("distributed run failed"), std::string::npos) << log0;
  if (mode == "--exit-after") { EXPECT_EQ(second[0].status, 0) << read_log(second[0]); }
}

TEST(DataParallelFailure, PeerExitsEarly) {
  if (!ch::distributed_available()) GTEST_SKIP() << "built without COLLIDER_DISTRIBUTED";
  expect_peer_failure("--exit-after", /*timeout_s=*/20, /*limit_s=*/25);
}

TEST(DataParallelFailure, PeerHangsPastTheTimeout) {
  if (!ch::distributed_available()) GTEST_SKIP() << "built without COLLIDER_DISTRIBUTED";
  expect_peer_failure("--hang-after", /*timeout_s=*/8, /*limit_s=*/25);
}

// `collider run` under scripts/launch.sh: one process per rank, rows from rank 0 only.
struct LaunchResult {
  int status = -1;
  std::string log;
  std::vector<nlohmann::json> rows;
};

LaunchResult launch_smoke(const ct::TempDir& dir, const std::string& extra) {
  const std::string src = COLLIDER_SOURCE_DIR, out = dir / "run", log = dir / "launch.log";
  const std::string cmd = "COLLIDER_BIN=" COLLIDER_BINARY_DIR "/collider COLLIDER_DIST_TIMEOUT_S=20 timeout 120 " +
                          src + "/scripts/launch.sh 2 " + src + "/experiments/smoke.toml --out " + out +
                          " --set run.measure_steps=1 --set run.warmup_steps=0 --set axes.filter_ratio=0.5"
                          " --set 'axes.method=[\"loss_only\",\"collider\"]' --set axes.attention_grad=kept_only " +
                          extra + " > " + log + " 2>&1";
  LaunchResult r;
  const int st = std::system(cmd.c_str());
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  r.log = collider::fsutil::exists(log) ? collider::fsutil::read_file(log) : "";
  const std::string results = out + "/results.jsonl";
  if (collider::fsutil::exists(results)) {
    std::istringstream in(collider::fsutil::read_file(results));
    for (std::string line; std::getline(in, line);) {
      if (!line.empty()) r.rows.push_back(nlohmann::json::parse(line));
    }
  }
  return r;
}

TEST(DataParallelCli, LaunchRunsOneProcessPerRankAndRank0WritesTheRows) {
  if (!ch::distributed_available()) GTEST_SKIP() << "built without COLLIDER_DISTRIBUTED";
  ct::TempDir dir("dist_cli");
  const LaunchResult r = launch_smoke(dir, "");
  ASSERT_EQ(r.status, 0) << r.log;
  ASSERT_EQ(r.rows.size(), 2u) << "one row per point, written once (by rank 0)\n" << r.log;
  for (const auto& row : r.rows) {
    EXPECT_EQ(row["status"], "ok") << row.dump();
    EXPECT_EQ(row["world_size"], 2);
    EXPECT_EQ(row["batch_size"], 2);  // per rank
    EXPECT_EQ(row["global_batch_size"], 4);
    EXPECT_EQ(row["rank_tokens_kept"], nlohmann::json::array({64, 64}));  // B=2 rows x T'=32 per rank
    EXPECT_EQ(row["global_tokens_kept"], 128);
    EXPECT_GT(row["allreduce_ms"].get<double>(), 0.0);
  }
  EXPECT_NE(r.log.find("[rank 1] collider run: rank 1 of 2: gloo process group up"), std::string::npos) << r.log;
}

TEST(DataParallelCli, AFailingPointEndsTheRunOnEveryRank) {
  if (!ch::distributed_available()) GTEST_SKIP() << "built without COLLIDER_DISTRIBUTED";
  ct::TempDir dir("dist_cli_fail");
  const LaunchResult r = launch_smoke(dir, "--set run.fail_point=collider");
  EXPECT_EQ(r.status, 3) << "launch.sh passes on the failing rank's status (3: distributed failure)\n" << r.log;
  ASSERT_EQ(r.rows.size(), 2u) << r.log;
  EXPECT_EQ(r.rows[0]["status"], "ok");
  EXPECT_EQ(r.rows[1]["status"], "error");
  EXPECT_NE(r.log.find("stops at the first failing point"), std::string::npos) << r.log;
}

TEST(DistEnv, ReadsAndValidatesTheLaunchVariables) {
  ::unsetenv("WORLD_SIZE");
  EXPECT_FALSE(ch::dist_env_from_environment().has_value());
  ::setenv("WORLD_SIZE", "2", 1);
  ::setenv("RANK", "1", 1);
  ::setenv("MASTER_ADDR", "10.0.0.1", 1);
  ::setenv("MASTER_PORT", "1234", 1);
  ::setenv("COLLIDER_DIST_TIMEOUT_S", "7", 1);
  ::unsetenv("LOCAL_RANK");
  auto e = ch::dist_env_from_environment();
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->rank, 1);
  EXPECT_EQ(e->local_rank, 1);
  EXPECT_EQ(e->world_size, 2);
  EXPECT_EQ(e->master_addr, "10.0.0.1");
  EXPECT_EQ(e->master_port, 1234);
  EXPECT_EQ(e->timeout, std::chrono::seconds(7));
  ::setenv("RANK", "2", 1);
  EXPECT_THROW(ch::dist_env_from_environment(), std::invalid_argument);
  ::setenv("RANK", "0", 1);
  ::setenv("MASTER_PORT", "http", 1);
  EXPECT_THROW(ch::dist_env_from_environment(), std::invalid_argument);
  for (const char* k : {"WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "COLLIDER_DIST_TIMEOUT_S"}) ::unsetenv(k);
}

}  // namespace
