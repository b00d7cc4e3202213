// One rank of the data-parallel runs in tests/test_distributed.cpp (started by it with RANK,
// WORLD_SIZE, MASTER_ADDR, MASTER_PORT set): trains tinyllama-debug for --steps steps with a
// GradientReducer (rank r on --rows[r] rows of each global batch, default 1) and writes one
// training checkpoint (rank 0 only) to --out; --bucket-kib sets the bucket size. Failure modes for
// the tests: --exit-after K (this rank returns 0 after K steps), --hang-after K (sleeps).
// A DistributedError is printed with the rank and ends the process with status 3 (as `collider run`).
//   RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500
//     build/tests/distributed_worker --method collider --steps 5 --out /tmp/ckpt
#include "distributed_test_util.h"

#include "models/checkpoint.h"

#include <signal.h>

#include <chrono>
#include <algorithm>
#include <iostream>
#include <string>
#include <vector>
#include <thread>

namespace ch = collider::harness;
namespace ct = collider::testing;

int main(int argc, char** argv) {
  ::signal(SIGPIPE, SIG_IGN);  // as build/collider: a dead peer's socket gives EPIPE, not a killed rank
  std::string method = "loss_only", out;
  int steps = 5, exit_after = -1, hang_after = -1;
  std::vector<int64_t> rows;  // per rank (default 1 each)
  ch::ReducerOptions reducer_options;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--method")
      method = v;
    else if (k == "--steps")
      steps = std::stoi(v);
    else if (k == "--bucket-kib")
      reducer_options.bucket_bytes = std::stoll(v) * 1024;
    else if (k == "--rows") {  // e.g. 1,2: rank 0 trains on 1 row of each global batch, rank 1 on the next 2
      for (size_t p = 0; p < v.size();) {
        const size_t q = std::min(v.find(',', p), v.size());
        rows.push_back(std::stoll(v.substr(p, q - p)));
        p = q + 1;
      }
    } else if (k == "--out")
      out = v;
    else if (k == "--exit-after")
      exit_after = std::stoi(v);
    else if (k == "--hang-after")
      hang_after = std::stoi(v);
    else {
      std::cerr << "distributed_worker: unknown option " << k << "\n";
      return 2;
    }
  }
  try {
    at::set_num_threads(1);
    const auto env = ch::dist_env_from_environment();
    if (!env) {
      std::cerr << "distributed_worker: WORLD_SIZE is not set\n";
      return 2;
    }
    if (rows.empty()) rows.assign(static_cast<size_t>(env->world_size), 1);
    if (static_cast<int>(rows.size()) != env->world_size) {
      std::cerr << "distributed_worker: --rows needs one count per rank (" << env->world_size << ")\n";
      return 2;
    }
    auto pg = ch::init_process_group(*env, torch::kCPU);
    ch::Trainer trainer = ct::make_dist_trainer(method);
    trainer.set_reducer(std::make_shared<ch::GradientReducer>(pg, trainer.model()->parameters(), reducer_options));
    nlohmann::json log = nlohmann::json::array();
    if (exit_after < 0 && hang_after < 0) {
      log = ct::run_dist_steps(trainer, steps, rows, env->rank);
    } else {
      // Failure modes: step by step so that the early exit / hang falls between two steps.
      torch::Generator gen = at::detail::createCPUGenerator(1);
      const int64_t V = trainer.model()->config().vocab_size;
      for (int s = 0; s < steps; ++s) {
        if (s == exit_after) {
          std::cerr << "distributed_worker: rank " << env->rank << " exits early after " << s << " steps\n";
          return 0;
        }
        if (s == hang_after) {
          std::cerr << "distributed_worker: rank " << env->rank << " hangs after " << s << " steps\n";
          std::this_thread::sleep_for(std::chrono::hours(1));
        }
        trainer.step(ch::random_batch(rows[static_cast<size_t>(env->rank)], ct::kDistT, V, gen, torch::kCPU));
      }
    }
    if (!out.empty()) {
      ch::run_on_rank0(pg.get(), [&] {
        collider::models::save_training_checkpoint(
            out, trainer.model(), collider::models::adamw_state_tensors(trainer.optimizer(), *trainer.model()),
            {{"steps", log}, {"world_size", env->world_size}});
      });
    }
    std::cerr << "distributed_worker: rank " << env->rank << " of " << env->world_size << " done\n";
    return 0;
  } catch (const ch::DistributedError& e) {
    std::cerr << "distributed_worker: distributed run failed: " << e.what() << "\n";
    return 3;
  } catch (const std::exception& e) {
    std::cerr << "distributed_worker: error: " << e.what() << "\n";
    return 1;
  }
}
