// Training runs (train_run.h): the manifest (config/train_manifest.h), the reference stage
// (recipes/reference_stage.h: train on the curated split, score the training pool once), then
// one training run per point (components/training_loop.h) with periodic evaluation, checkpoints,
// resume and a progress line; data-parallel with a process group (rank 0 writes, evaluates and
// runs the reference stage; every rank trains on its own windows).
#include "harness/recipes/train_run.h"

#include "harness/recipes/reference_stage.h"

#include "harness/components/distributed.h"
#include "base/duration.h"
#include "base/fsutil.h"
#include "base/fault.h"
#include "harness/run/results.h"
#include "harness/run/run_dir.h"
#include "harness/run/run_lock.h"
#include "harness/components/token_data.h"
#include "harness/components/train_step.h"
#include "harness/components/training_loop.h"
#include "models/checkpoint.h"
#include "models/model.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <memory>
#include <optional>
#include <sstream>

#include <unistd.h>

namespace collider::harness {

std::string expand_home(const std::string& path) {
  if (path == "~" || path.rfind("~/", 0) == 0) {
    const char* home = std::getenv("HOME");
    return std::string(home ? home : "") + path.substr(1);
  }
  return path;
}

namespace {

struct EvalSet {
  std::string name;
  std::shared_ptr<TokenShard> shard;
  int64_t windows = 0;
};

std::string fmt_num(double v) { return fmt::format("{}", v); }

// The key of a training row in Resumed::written: (point, step, eval set; "" for a training-loss row).
std::string row_key(const std::string& pid, int64_t step, const std::string& eval_set) {
  return fmt::format("{}|{}|{}", pid, step, eval_set);
}

// What --resume finds in results.jsonl (rank 0's view: it read the rows; every rank skips the same
// runs). A run is finished when every eval set has its final row (a kill between two of them
// leaves it unfinished); rows already written are not written again by a run resumed from a
// checkpoint older than its last rows.
struct Resumed {
  std::set<std::string> written;  // row_key of every ok row
  std::set<std::string> done;     // point ids of finished runs
};

Resumed read_resumed(const ExistingResults& existing, const std::vector<std::string>& eval_splits) {
  Resumed r;
  std::map<std::string, std::set<std::string>> final_sets;
  for (const auto& row : existing.rows) {
    if (row.value("status", "") != "ok" || !row.contains("step") || !row["step"].is_number_integer()) continue;
    const std::string pid = row.value("point_id", "");
    const std::string set =
        row.contains("eval_set") && row["eval_set"].is_string() ? row["eval_set"].get<std::string>() : "";
    r.written.insert(row_key(pid, row["step"].get<int64_t>(), set));
    if (row.value("final", false) && !set.empty()) final_sets[pid].insert(set);
  }
  for (const auto& [pid, sets_done] : final_sets) {
    bool all = true;
    for (const auto& e : eval_splits) all = all && sets_done.count(e) > 0;
    if (all) r.done.insert(pid);
  }
  return r;
}

// A training run's rows before their step: identity, provenance and the run's settings.
nlohmann::json training_row(const TrainManifest& m, const TrainPoint& p, const std::string& pid, const Provenance& prov,
                            const models::ModelConfig& cfg, const std::string& ref_tag, const std::string& data_dir,
                            int world) {
  const TrainSettings& s = m.train;
  nlohmann::json base = identity_row({m.name, pid, s.model, s.seq_len, s.batch_size, p.filter_ratio,
                                      to_string(p.spec.method), models::attention_grad_name(p.spec), "fp32", "cpu"},
                                     prov);
  base.update({{"seed", s.seed},
               {"steps_total", s.steps},
               {"num_params", cfg.num_params()},
               {"score", models::uses_selection(p.spec.method) ? to_string(p.spec.score) : "none"},
               {"selection", models::uses_selection(p.spec.method) ? collider::to_string(p.spec.policy) : "none"},
               {"reference", ref_tag},
               {"data_dir", data_dir},
               {"train_split", s.train_split},
               {"scale", "cpu"},
               {"world_size", world},
               {"global_batch_size", world * s.batch_size}});
  return base;
}

// --dry-run: the runs a manifest would make, one line each.
void print_runs(const TrainManifest& m, const std::string& data_dir, std::ostream& out) {
  const TrainSettings& s = m.train;
  out << fmt::format(
      "{}: training manifest, {} runs of {} steps x {} x {} tokens ({} tokens each), seed {}; "
      "reference {} steps on {}; data {}\n",
      m.name, m.points.size(), s.steps, s.batch_size, s.seq_len, s.steps * s.batch_size * s.seq_len, s.seed,
      s.ref_steps, s.reference_split, data_dir);
  for (size_t i = 0; i < m.points.size(); ++i) out << fmt::format("{:>4}  {}\n", i + 1, m.points[i].id(s));
}

// The token shards a training manifest reads: the training pool, the curated reference split and
// the eval sets (each read in windows of seq_len, up to eval_tokens).
struct TrainData {
  std::shared_ptr<TokenShard> train, reference;
  std::vector<EvalSet> evals;
};

TrainData open_data(const TrainSettings& s, const std::string& data_dir, const models::ModelConfig& cfg) {
  auto shard = [&](const std::string& split) {
    return std::make_shared<TokenShard>(fsutil::join(data_dir, split + ".bin"));
  };
  TrainData d;
  d.train = shard(s.train_split);
  d.reference = shard(s.reference_split);
  if (d.train->header().vocab_size > static_cast<uint32_t>(cfg.vocab_size)) {
    throw std::runtime_error(fmt::format("the tokenizer of {} has {} pieces but {} has vocab_size {}", data_dir,
                                         d.train->header().vocab_size, s.model, cfg.vocab_size));
  }
  for (const auto& e : s.eval_splits) {
    auto sh = shard(e);
    const int64_t w = std::min((sh->size() - 1) / s.seq_len, std::max<int64_t>(1, s.eval_tokens / s.seq_len));
    d.evals.push_back({e, sh, w});
  }
  return d;
}

// The mean loss of `model` on each eval set.
std::vector<std::pair<std::string, double>> evaluate(const TrainData& d, const TrainSettings& s,
                                                     models::CausalLM& model) {
  std::vector<std::pair<std::string, double>> r;
  for (const auto& e : d.evals) {
    r.emplace_back(e.name, mean_window_loss(model, *e.shard, s.seq_len, e.windows, s.eval_batch_size));
  }
  return r;
}

// What every training run of one command shares.
struct RunContext {
  const TrainManifest& m;
  const models::ModelConfig& cfg;  // the preset of train.model
  const TrainData& data;
  WindowLoader& loader;
  const RefLosses& ref_losses;
  const Resumed& resumed;
  JsonlWriter* rows;  // null on the ranks that do not write
  torch::Device device;
  std::shared_ptr<ProcessGroup> dist;
  bool resume;
  std::ostream& log;
};

// One training run, point i of the manifest: its model and trainer, the loop with a training-loss
// row per logged step and eval rows per eval step, its checkpoints in ckpt_dir (removed once it
// finished: its rows hold the result).
void train_point(const RunContext& c, size_t i, const nlohmann::json& base, const std::string& pid,
                 const std::string& ckpt_dir) {
  const TrainSettings& s = c.m.train;
  const TrainPoint& p = c.m.points[i];
  const StepConfig sc = step_config(s, p.spec, p.filter_ratio);
  Trainer tr(models::build_model(c.cfg, models::AttentionImpl::kEager, s.seed), sc, c.device, s.seed);
  if (c.dist) tr.set_reducer(std::make_shared<GradientReducer>(c.dist, tr.model()->parameters()));
  RunSpec spec;
  spec.label = fmt::format("[{}/{} {} {}{}]", i + 1, c.m.points.size(), to_string(p.spec.method),
                           p.spec.method == Method::kCollider ? models::attention_grad_name(p.spec) + " " : "",
                           fmt_num(p.filter_ratio));
  spec.step_cfg = sc;
  spec.loader = &c.loader;
  spec.ref = models::uses_selection(p.spec.method) ? &c.ref_losses : nullptr;  // regular, forward_drop: none
  spec.steps = s.steps;
  spec.warmup_steps = s.warmup_steps;
  spec.lr = s.lr;
  spec.min_lr = s.min_lr;
  spec.ckpt_dir = ckpt_dir;
  spec.resume = c.resume;
  spec.may_stop = true;
  spec.dist = c.dist.get();
  const std::set<std::string>& written = c.resumed.written;
  auto progress = [&](nlohmann::json& row, const RunState& st, double lr) {
    row["step"] = st.step;
    row["elapsed_s"] = st.elapsed_s;
    row["tokens_seen"] = st.tokens_seen;
    row["tokens_backprop"] = st.tokens_backprop;
    write_kept_counts(row, st.last_kept_per_row);  // the logged step's rows (ragged under batch_topk)
    row["lr"] = lr;
    row["final"] = st.step == s.steps;
    row["timestamp"] = utc_timestamp();
  };
  train_loop(
      s, spec, tr,
      [&](const RunState& st, double train_loss, double train_loss_kept, double lr) {
        if (!c.rows || written.count(row_key(pid, st.step, ""))) return;
        nlohmann::json row = base;  // a training-loss row (no eval_set)
        progress(row, st, lr);
        row["final"] = false;  // the eval rows of the last step mark the run finished
        row["train_loss"] = train_loss;
        row["train_loss_kept"] = train_loss_kept;
        row["eval_set"] = nullptr;
        c.rows->append(row);
      },
      [&](const RunState& st, double lr) {
        const auto te = Clock::now();
        const auto ev = evaluate(c.data, s, tr.model());
        const double eval_s = seconds_since(te);
        for (const auto& [name, loss] : ev) {
          if (written.count(row_key(pid, st.step, name))) continue;  // written before a kill
          nlohmann::json row = base;
          progress(row, st, lr);
          row["eval_set"] = name;
          row["val_loss"] = loss;
          row["val_ppl"] = std::exp(loss);
          row["eval_tokens"] = c.data.evals.front().windows * s.seq_len;
          row["eval_s"] = eval_s;
          c.rows->append(row);  // on_eval runs on rank 0 only
          c.log << fmt::format("{} step {} eval {} loss {:.4f} ppl {:.2f}\n", spec.label, st.step, name, loss,
                               std::exp(loss));
        }
      },
      c.log);
}

// A failed run's row: its identity, status "error" and the message.
nlohmann::json error_row(const nlohmann::json& base, const std::string& what) {
  nlohmann::json row = base;
  row["status"] = "error";
  row["error"] = what;
  row["step"] = 0;
  row["timestamp"] = utc_timestamp();
  return row;
}

}  // namespace

int run_train_command(const std::string& manifest_path, const std::vector<std::string>& sets, std::string out_dir,
                      bool dry_run, bool resume, std::ostream& out, std::ostream& err,
                      std::shared_ptr<ProcessGroup> dist_ptr) {
  ProcessGroup* dist = dist_ptr.get();
  const int rank = dist ? dist->rank() : 0, world = dist ? dist->world_size() : 1;
  const bool writer = rank == 0;  // only rank 0 touches files and prints progress
  const std::string rank_tag = dist ? fmt::format("rank {} of {}: ", rank, world) : "";
  std::ostream null_log(nullptr);  // discards (the other ranks' progress lines)
  std::ostream& log = writer ? err : null_log;
  TrainManifest m;
  try {
    m = load_train_manifest(manifest_path, sets);
  } catch (const ManifestError& e) {
    err << "collider run: " << rank_tag << "error: " << e.what() << "\n";
    return 2;
  }
  for (const auto& o : m.overrides) log << o << "\n";
  const TrainSettings& s = m.train;
  const std::string data_dir = expand_home(s.data_dir);
  // One pass over the scored pool: every step takes world_size x batch_size windows.
  const int64_t pool = s.pool_windows > 0 ? s.pool_windows : s.steps * s.batch_size * world;
  if (dry_run) {
    print_runs(m, data_dir, out);
    return 0;
  }
  if (out_dir.empty() && writer) {
    try {
      out_dir = default_run_dir(m.name, resume);
    } catch (const std::runtime_error& e) {
      err << "collider run: " << e.what() << "\n";
      return 2;  // the other ranks' next collective fails: they end too
    }
  }
  try {
    out_dir = from_rank0(dist, out_dir, "the output directory");  // checkpoints to resume from live there
    if (s.threads > 0) torch::set_num_threads(static_cast<int>(s.threads));
    const torch::Device device(torch::kCPU);
    const Provenance prov = collect_provenance(device);
    const RunDir run_dir(out_dir, resume, writer, log);
    const std::string& results_path = run_dir.results_path();
    run_dir.write_records(m.resolved_toml, prov, dist, log);
    log << fmt::format("collider run: {} ({} training runs, {} steps each{}) -> {}\n", m.name, m.points.size(), s.steps,
                       dist ? fmt::format(", {} ranks x batch {}", world, s.batch_size) : "", out_dir);
    const auto& cfg = models::preset(s.model);
    const TrainData data = open_data(s, data_dir, cfg);

    // Reference stage: train (regular) on the curated split, then score the training pool once.
    const ReferenceStage ref = run_reference_stage(
        s, data_dir, pool, data.reference, *data.train,
        [&](models::CausalLM& model) { return evaluate(data, s, model); }, dist, log);
    RefLosses ref_losses(ref.losses_path);
    if (ref_losses.shard_tokens() != data.train->size() || ref_losses.seq_len() != s.seq_len ||
        ref_losses.num_windows() < pool) {
      throw std::runtime_error(
          fmt::format("{} does not match the shard {} (delete it to recompute)", ref.losses_path, data.train->path()));
    }
    if (writer && fsutil::exists(fsutil::join(ref.dir, "reference.json"))) {
      fsutil::write_file_atomic(fsutil::join(out_dir, "reference.json"),
                                fsutil::read_file(fsutil::join(ref.dir, "reference.json")));
    }

    // Training runs.
    // Rank r takes windows [r*B, (r+1)*B) of each step's global batch of world_size x B.
    WindowLoader loader(data.train, s.seq_len, s.batch_size, static_cast<uint64_t>(s.seed), pool, rank, world);
    std::unique_ptr<JsonlWriter> rows = run_dir.open_rows();
    const Resumed resumed = read_resumed(run_dir.existing(), s.eval_splits);
    const RunContext context{m, cfg, data, loader, ref_losses, resumed, rows.get(), device, dist_ptr, resume, log};
    int64_t failed = 0;
    const auto t_all = Clock::now();
    for (size_t i = 0; i < m.points.size(); ++i) {
      const std::string pid = m.points[i].id(s);
      std::string slug = pid;
      for (char& c : slug) c = c == '/' ? '_' : c;
      const std::string ckpt_dir = fsutil::join(fsutil::join(out_dir, "checkpoints"), slug);
      if (from_rank0(dist, resumed.done.count(pid), "whether a run is finished") != 0) {
        log << fmt::format("[{}/{}] {}: already finished (resume)\n", i + 1, m.points.size(), pid);
        if (writer) remove_checkpoint(ckpt_dir);  // left by a kill after its last rows
        continue;
      }
      const nlohmann::json base = training_row(m, m.points[i], pid, prov, cfg, ref.tag, data_dir, world);
      try {
        train_point(context, i, base, pid, ckpt_dir);
        if (writer) remove_checkpoint(ckpt_dir);  // finished: the rows hold the result
        log << fmt::format("[{}/{}] {} done; all runs so far {}\n", i + 1, m.points.size(), pid,
                           hms(seconds_since(t_all)));
      } catch (const SimulatedKill&) { throw; } catch (const DistributedError&) {
        throw;
      } catch (const fsutil::WriteError&) {
        throw;  // no space or no permission: the next run would fail the same way; end here
      } catch (const std::exception& e) {
        failed += 1;
        if (rows) rows->append(error_row(base, e.what()));
        err << fmt::format("{}[{}/{}] {}: error: {}\n", rank_tag, i + 1, m.points.size(), pid, e.what());
        if (dist) {
          // The other ranks may be inside a collective of this run: stop (exiting closes this rank's
          // connections, so they fail fast instead of running mismatched collectives).
          throw DistributedError(
              fmt::format("{}training run {} failed ({}); a data-parallel run stops at the first "
                          "failing run",
                          rank_tag, pid, e.what()));
        }
      }
    }
    if (writer) ::rmdir(fsutil::join(out_dir, "checkpoints").c_str());  // only when empty: every run finished
    log << fmt::format("collider run: {} runs, {} failed; rows in {}\n", m.points.size(), failed, results_path);
    return failed > 0 ? 1 : 0;
  } catch (...) { return run_failure_status(err, rank_tag, std::current_exception()); }
}

}  // namespace collider::harness
