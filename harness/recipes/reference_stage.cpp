// The reference stage of a training manifest (reference_stage.h).
#include "harness/recipes/reference_stage.h"

#include "base/fsutil.h"
#include "harness/components/train_step.h"
#include "harness/components/training_loop.h"
#include "harness/run/run_lock.h"
#include "models/checkpoint.h"
#include "models/hf_tensors.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <ostream>

namespace collider::harness {

StepConfig step_config(const TrainSettings& s, const models::MethodSpec& spec, double filter_ratio) {
  StepConfig sc;
  sc.spec = spec;
  sc.filter_ratio = filter_ratio;
  sc.align = s.align;
  sc.weight_decay = s.weight_decay;
  sc.grad_clip = s.grad_clip;
  sc.fused_head = s.head == "fused";
  return sc;
}

ReferenceStage run_reference_stage(const TrainSettings& s, const std::string& data_dir, int64_t pool,
                                   const std::shared_ptr<TokenShard>& reference_shard, const TokenShard& train_shard,
                                   const Evaluate& evaluate, ProcessGroup* dist, std::ostream& log) {
  const models::ModelConfig& cfg = models::preset(s.model);
  const torch::Device device(torch::kCPU);
  const std::string ref_tag =
      fmt::format("{}-T{}-B{}-s{}-lr{}-seed{}", s.model, s.seq_len, s.ref_batch_size, s.ref_steps, s.ref_lr, s.seed);
  const std::string ref_dir = fsutil::join(fsutil::join(data_dir, "reference"), ref_tag);
  const std::string ref_losses_path =
      fsutil::join(ref_dir, fmt::format("{}.T{}.W{}.reflosses.f32", s.train_split, s.seq_len, pool));
  const std::string ref_model_dir = fsutil::join(ref_dir, "model");
  // Rank 0 alone runs the reference stage (it writes files beside the shards); the others wait at
  // a barrier, bounded by COLLIDER_DIST_TIMEOUT_S: a long reference stage is best run once by a
  // single process first (its results are reused).
  run_on_rank0(dist, [&] {
    // Runs that share a data directory compute its reference stage once: the first takes the
    // lock of ref_dir, the others wait and then find the stored losses.
    RunDirLock ref_lock = RunDirLock::acquire_waiting(ref_dir, log, "reference stage of collider run");
    if (!fsutil::exists(ref_losses_path)) {
      models::CausalLM ref_model = models::build_model(cfg, models::AttentionImpl::kEager, s.seed);
      if (fsutil::exists(fsutil::join(ref_model_dir, "config.json"))) {
        models::load_hf_weights(ref_model, ref_model_dir);
        log << "reference: model from " << ref_model_dir << "\n";
      } else {
        StepConfig sc = step_config(s, models::MethodSpec{}, 0.0);  // method regular
        sc.fused_head = false;  // the reference model trains with its own LM head
        Trainer tr(ref_model, sc, device, s.seed);
        WindowLoader loader(reference_shard, s.seq_len, s.ref_batch_size, static_cast<uint64_t>(s.seed) + 1000);
        RunSpec spec;
        spec.label = "[reference " + s.reference_split + "]";
        spec.step_cfg = sc;
        spec.loader = &loader;
        spec.steps = s.ref_steps;
        spec.warmup_steps = std::min(s.warmup_steps, s.ref_steps / 2);
        spec.lr = s.ref_lr;
        spec.min_lr = s.min_lr * s.ref_lr / s.lr;
        spec.ckpt_dir = fsutil::join(ref_dir, "checkpoint");
        spec.resume = true;  // the reference stage always continues an interrupted reference run
        nlohmann::json ref_record = {
            {"tag", ref_tag}, {"split", s.reference_split}, {"evals", nlohmann::json::array()}};
        train_loop(
            s, spec, tr, [](const RunState&, double, double, double) {},
            [&](const RunState& st, double) {
              nlohmann::json e = {{"step", st.step}, {"elapsed_s", st.elapsed_s}};
              for (const auto& [name, loss] : evaluate(tr.model())) {
                e[name] = loss;
                log << fmt::format("{} step {} eval {} loss {:.4f} ppl {:.2f}\n", spec.label, st.step, name, loss,
                                   std::exp(loss));
              }
              ref_record["evals"].push_back(e);
            },
            log);
        // Written whole under a temporary name and renamed: its config.json marks it as usable.
        const std::string ref_model_tmp = ref_model_dir + ".tmp";
        fsutil::remove_tree(ref_model_tmp);
        models::save_hf_model(tr.model(), ref_model_tmp);
        fsutil::remove_tree(ref_model_dir);
        fsutil::rename_path(ref_model_tmp, ref_model_dir);
        fsutil::write_file_atomic(fsutil::join(ref_dir, "reference.json"), ref_record.dump(1) + "\n");
        remove_checkpoint(spec.ckpt_dir);
      }
      log << fmt::format("reference: scoring {} windows of {} (T = {}) -> {}\n", pool, s.train_split, s.seq_len,
                         ref_losses_path);
      const auto t0 = Clock::now();
      compute_ref_losses(ref_model, train_shard, s.seq_len, pool, s.eval_batch_size, ref_losses_path, &log);
      log << fmt::format("reference: scored in {:.1f} s\n", seconds_since(t0));
    } else {
      log << "reference: losses from " << ref_losses_path << "\n";
    }
  });
  return {ref_tag, ref_dir, ref_losses_path};
}

}  // namespace collider::harness
