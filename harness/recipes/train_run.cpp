// Training runs (train_run.h) as a sequence of phases (TrainingRun, one function each): the run
// directory, the data, the reference stage (recipes/reference_stage.h: train on the curated split,
// score the training pool once), then one training run per point (components/training_loop.h) with
// periodic evaluation, checkpoints, resume and a progress line; data-parallel with a process group
// (rank 0 writes, evaluates and runs the reference stage; every rank trains on its own windows).
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

// The mean loss of `model` on each eval set.
std::vector<std::pair<std::string, double>> evaluate(const TrainData& d, const TrainSettings& s,
                                                     models::CausalLM& model) {
  std::vector<std::pair<std::string, double>> r;
  for (const auto& e : d.evals) {
    r.emplace_back(e.name, mean_window_loss(model, *e.shard, s.seq_len, e.windows, s.eval_batch_size));
  }
  return r;
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

std::string rank_tag_of(const ProcessGroup* dist) {
  return dist ? fmt::format("rank {} of {}: ", dist->rank(), dist->world_size()) : "";
}

// One `collider run` of a training manifest as its phases, one function each, which
// run_train_command calls in order (as measure_group runs a timing group's, measure/group.cpp):
// open_run_dir, open_data, reference_stage, train_points (each point: train_point, whose loop
// calls write_loss_row and evaluate_and_write), finish. Rank 0 alone writes files and progress.
class TrainingRun {
 public:
  TrainingRun(const TrainManifest& m, std::shared_ptr<ProcessGroup> dist, bool resume, std::ostream& log,
              std::ostream& err)
      : m_(m),
        s_(m.train),
        dist_ptr_(std::move(dist)),
        dist_(dist_ptr_.get()),
        rank_(dist_ ? dist_->rank() : 0),
        world_(dist_ ? dist_->world_size() : 1),
        writer_(rank_ == 0),
        resume_(resume),
        rank_tag_(rank_tag_of(dist_)),
        data_dir_(expand_home(s_.data_dir)),
        // One pass over the scored pool: every step takes world_size x batch_size windows.
        pool_(s_.pool_windows > 0 ? s_.pool_windows : s_.steps * s_.batch_size * world_),
        log_(log),
        err_(err) {}

  // The output directory (rank 0's: the checkpoints to resume from live there), its records and
  // the run's line.
  void open_run_dir(const std::string& out_dir) {
    out_dir_ = from_rank0(dist_, out_dir, "the output directory");
    if (s_.threads > 0) torch::set_num_threads(static_cast<int>(s_.threads));
    prov_ = collect_provenance(device_);
    run_dir_ = std::make_unique<RunDir>(out_dir_, resume_, writer_, log_);
    run_dir_->write_records(m_.resolved_toml, prov_, dist_, log_);
    log_ << fmt::format("collider run: {} ({} training runs, {} steps each{}) -> {}\n", m_.name, m_.points.size(),
                        s_.steps, dist_ ? fmt::format(", {} ranks x batch {}", world_, s_.batch_size) : "", out_dir_);
  }

  // The token shards: the training pool, the curated reference split and the eval sets (each read
  // in windows of seq_len, up to eval_tokens).
  void open_data() {
    cfg_ = &models::preset(s_.model);
    auto shard = [&](const std::string& split) {
      return std::make_shared<TokenShard>(fsutil::join(data_dir_, split + ".bin"));
    };
    data_.train = shard(s_.train_split);
    data_.reference = shard(s_.reference_split);
    if (data_.train->header().vocab_size > static_cast<uint32_t>(cfg_->vocab_size)) {
      throw std::runtime_error(fmt::format("the tokenizer of {} has {} pieces but {} has vocab_size {}", data_dir_,
                                           data_.train->header().vocab_size, s_.model, cfg_->vocab_size));
    }
    for (const auto& e : s_.eval_splits) {
      auto sh = shard(e);
      const int64_t w = std::min((sh->size() - 1) / s_.seq_len, std::max<int64_t>(1, s_.eval_tokens / s_.seq_len));
      data_.evals.push_back({e, sh, w});
    }
  }

  // The reference stage (reference_stage.h): train (regular) on the curated split, then score the
  // training pool once; its losses checked against the pool, its reference.json copied beside the rows.
  void reference_stage() {
    ref_ = run_reference_stage(
        s_, data_dir_, pool_, data_.reference, *data_.train,
        [&](models::CausalLM& model) { return evaluate(data_, s_, model); }, dist_, log_);
    ref_losses_ = std::make_unique<RefLosses>(ref_.losses_path);
    if (ref_losses_->shard_tokens() != data_.train->size() || ref_losses_->seq_len() != s_.seq_len ||
        ref_losses_->num_windows() < pool_) {
      throw std::runtime_error(fmt::format("{} does not match the shard {} (delete it to recompute)", ref_.losses_path,
                                           data_.train->path()));
    }
    if (writer_ && fsutil::exists(fsutil::join(ref_.dir, "reference.json"))) {
      fsutil::write_file_atomic(fsutil::join(out_dir_, "reference.json"),
                                fsutil::read_file(fsutil::join(ref_.dir, "reference.json")));
    }
  }

  // The training runs, one per point, on the same windows: rank r takes windows [r*B, (r+1)*B) of
  // each step's global batch of world_size x B.
  void train_points() {
    loader_ = std::make_unique<WindowLoader>(data_.train, s_.seq_len, s_.batch_size, static_cast<uint64_t>(s_.seed),
                                             pool_, rank_, world_);
    rows_ = run_dir_->open_rows();
    resumed_ = read_resumed(run_dir_->existing(), s_.eval_splits);
    t_all_ = Clock::now();
    for (size_t i = 0; i < m_.points.size(); ++i) run_point(i);
  }

  // The summary line; the status: 1 when a run failed.
  int finish() {
    if (writer_) ::rmdir(fsutil::join(out_dir_, "checkpoints").c_str());  // only when empty: every run finished
    log_ << fmt::format("collider run: {} runs, {} failed; rows in {}\n", m_.points.size(), failed_,
                        run_dir_->results_path());
    return failed_ > 0 ? 1 : 0;
  }

 private:
  // Point i: skipped when already finished (resume), else trained, its checkpoint removed once it
  // finished (its rows hold the result); a failed run gets its error row and the next one starts,
  // except in a data-parallel run, which stops there.
  void run_point(size_t i) {
    const std::string pid = m_.points[i].id(s_);
    std::string slug = pid;
    for (char& c : slug) c = c == '/' ? '_' : c;
    const std::string ckpt_dir = fsutil::join(fsutil::join(out_dir_, "checkpoints"), slug);
    if (from_rank0(dist_, resumed_.done.count(pid), "whether a run is finished") != 0) {
      log_ << fmt::format("[{}/{}] {}: already finished (resume)\n", i + 1, m_.points.size(), pid);
      if (writer_) remove_checkpoint(ckpt_dir);  // left by a kill after its last rows
      return;
    }
    const nlohmann::json base = training_row(m_, m_.points[i], pid, prov_, *cfg_, ref_.tag, data_dir_, world_);
    try {
      train_point(i, base, pid, ckpt_dir);
      if (writer_) remove_checkpoint(ckpt_dir);
      log_ << fmt::format("[{}/{}] {} done; all runs so far {}\n", i + 1, m_.points.size(), pid,
                          hms(seconds_since(t_all_)));
    } catch (const SimulatedKill&) { throw; } catch (const DistributedError&) {
      throw;
    } catch (const fsutil::WriteError&) {
      throw;  // no space or no permission: the next run would fail the same way; end here
    } catch (const std::exception& e) { fail_point(i, base, pid, e); }
  }

  // A failed run: its error row and message. A data-parallel run stops here: the other ranks may
  // be inside a collective of this run (exiting closes this rank's connections, so they fail fast
  // instead of running mismatched collectives).
  void fail_point(size_t i, const nlohmann::json& base, const std::string& pid, const std::exception& e) {
    failed_ += 1;
    if (rows_) rows_->append(error_row(base, e.what()));
    err_ << fmt::format("{}[{}/{}] {}: error: {}\n", rank_tag_, i + 1, m_.points.size(), pid, e.what());
    if (dist_) {
      throw DistributedError(
          fmt::format("{}training run {} failed ({}); a data-parallel run stops at the first failing run", rank_tag_,
                      pid, e.what()));
    }
  }

  // One training run, point i: its model and trainer, and the loop (training_loop.h) with its
  // checkpoints in ckpt_dir, a training-loss row per logged step and the eval rows per eval step.
  void train_point(size_t i, const nlohmann::json& base, const std::string& pid, const std::string& ckpt_dir) {
    const TrainPoint& p = m_.points[i];
    const StepConfig sc = step_config(s_, p.spec, p.filter_ratio);
    Trainer tr(models::build_model(*cfg_, models::AttentionImpl::kEager, s_.seed), sc, device_, s_.seed);
    if (dist_) tr.set_reducer(std::make_shared<GradientReducer>(dist_ptr_, tr.model()->parameters()));
    RunSpec spec;
    spec.label = fmt::format("[{}/{} {} {}{}]", i + 1, m_.points.size(), to_string(p.spec.method),
                             p.spec.method == Method::kCollider ? models::attention_grad_name(p.spec) + " " : "",
                             fmt_num(p.filter_ratio));
    spec.step_cfg = sc;
    spec.loader = loader_.get();
    spec.ref = models::uses_selection(p.spec.method) ? ref_losses_.get() : nullptr;  // regular, forward_drop: none
    spec.steps = s_.steps;
    spec.warmup_steps = s_.warmup_steps;
    spec.lr = s_.lr;
    spec.min_lr = s_.min_lr;
    spec.ckpt_dir = ckpt_dir;
    spec.resume = resume_;
    spec.may_stop = true;
    spec.dist = dist_;
    train_loop(
        s_, spec, tr,
        [&](const RunState& st, double train_loss, double train_loss_kept, double lr) {
          write_loss_row(base, pid, st, train_loss, train_loss_kept, lr);
        },
        [&](const RunState& st, double lr) { evaluate_and_write(tr.model(), spec.label, base, pid, st, lr); }, log_);
  }

  // A logged step's training-loss row (no eval_set), unless a run killed after it wrote it.
  void write_loss_row(const nlohmann::json& base, const std::string& pid, const RunState& st, double train_loss,
                      double train_loss_kept, double lr) {
    if (!rows_ || resumed_.written.count(row_key(pid, st.step, ""))) return;
    nlohmann::json row = base;
    write_progress(row, st, lr);
    row["final"] = false;  // the eval rows of the last step mark the run finished
    row["train_loss"] = train_loss;
    row["train_loss_kept"] = train_loss_kept;
    row["eval_set"] = nullptr;
    rows_->append(row);
  }

  // An eval step (rank 0 only): the model's loss on each eval set, one row and one line each.
  void evaluate_and_write(models::CausalLM& model, const std::string& label, const nlohmann::json& base,
                          const std::string& pid, const RunState& st, double lr) {
    const auto te = Clock::now();
    const auto ev = evaluate(data_, s_, model);
    const double eval_s = seconds_since(te);
    for (const auto& [name, loss] : ev) {
      if (resumed_.written.count(row_key(pid, st.step, name))) continue;  // written before a kill
      nlohmann::json row = base;
      write_progress(row, st, lr);
      row["eval_set"] = name;
      row["val_loss"] = loss;
      row["val_ppl"] = std::exp(loss);
      row["eval_tokens"] = data_.evals.front().windows * s_.seq_len;
      row["eval_s"] = eval_s;
      rows_->append(row);
      log_ << fmt::format("{} step {} eval {} loss {:.4f} ppl {:.2f}\n", label, st.step, name, loss, std::exp(loss));
    }
  }

  // Where the run stands, in each of its rows.
  void write_progress(nlohmann::json& row, const RunState& st, double lr) const {
    row["step"] = st.step;
    row["elapsed_s"] = st.elapsed_s;
    row["tokens_seen"] = st.tokens_seen;
    row["tokens_backprop"] = st.tokens_backprop;
    write_kept_counts(row, st.last_kept_per_row);  // the logged step's rows (ragged under batch_topk)
    row["lr"] = lr;
    row["final"] = st.step == s_.steps;
    row["timestamp"] = utc_timestamp();
  }

  const TrainManifest& m_;
  const TrainSettings& s_;
  const std::shared_ptr<ProcessGroup> dist_ptr_;  // null: one process
  ProcessGroup* const dist_;
  const int rank_, world_;
  const bool writer_;  // rank 0: touches files and prints progress
  const bool resume_;
  const std::string rank_tag_, data_dir_;
  const int64_t pool_;  // windows of the training pool scored and trained on
  std::ostream& log_;   // progress (discards on the other ranks)
  std::ostream& err_;
  const torch::Device device_{torch::kCPU};
  // Made by the phases, in this order (and destroyed in the reverse).
  std::string out_dir_;
  Provenance prov_;
  std::unique_ptr<RunDir> run_dir_;
  const models::ModelConfig* cfg_ = nullptr;  // the preset of train.model
  TrainData data_;
  ReferenceStage ref_;
  std::unique_ptr<RefLosses> ref_losses_;
  std::unique_ptr<WindowLoader> loader_;
  std::unique_ptr<JsonlWriter> rows_;  // null on the ranks that do not write
  Resumed resumed_;
  Clock::time_point t_all_;
  int64_t failed_ = 0;
};

}  // namespace

int run_train_command(const std::string& manifest_path, const std::vector<std::string>& sets, std::string out_dir,
                      bool dry_run, bool resume, std::ostream& out, std::ostream& err,
                      std::shared_ptr<ProcessGroup> dist) {
  const bool writer = !dist || dist->rank() == 0;  // only rank 0 touches files and prints progress
  std::ostream null_log(nullptr);                  // discards (the other ranks' progress lines)
  std::ostream& log = writer ? err : null_log;
  TrainManifest m;
  try {
    m = load_train_manifest(manifest_path, sets);
  } catch (const ManifestError& e) {
    err << "collider run: " << rank_tag_of(dist.get()) << "error: " << e.what() << "\n";
    return 2;
  }
  for (const auto& o : m.overrides) log << o << "\n";
  if (dry_run) {
    print_runs(m, expand_home(m.train.data_dir), out);
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
    TrainingRun run(m, dist, resume, log, err);
    run.open_run_dir(out_dir);
    run.open_data();
    run.reference_stage();
    run.train_points();
    return run.finish();
  } catch (...) { return run_failure_status(err, rank_tag_of(dist.get()), std::current_exception()); }
}

}  // namespace collider::harness
