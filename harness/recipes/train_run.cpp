// Training manifests and runs (train_run.h): load + validate, the reference stage (train on the
// curated split, score the training pool once), then one training run per point with periodic
// evaluation, checkpoints, resume and a progress line; data-parallel with a process group
// (rank 0 writes, evaluates and runs the reference stage; every rank trains on its own windows).
#include "harness/recipes/train_run.h"

#include "harness/components/distributed.h"
#include "base/fsutil.h"
#include "harness/config/manifest.h"
#include "base/fault.h"
#include "harness/run/results.h"
#include "harness/run/run_dir.h"
#include "harness/run/run_lock.h"
#include "harness/components/token_data.h"
#include "harness/config/toml_set.h"
#include "harness/components/train_step.h"
#include "models/checkpoint.h"
#include "models/model.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <toml++/toml.h>

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

std::string TrainPoint::id(const TrainSettings& s) const {
  return fmt::format("{}/T{}/B{}/f{}/{}/{}", s.model, s.seq_len, s.batch_size, filter_ratio, method, attention_grad);
}

namespace {

using Clock = std::chrono::steady_clock;

// train.stop_after (tests): stands for a killed process.
struct SimulatedKill : std::runtime_error {
  SimulatedKill() : std::runtime_error("stopped after a checkpoint (train.stop_after, tests)") {}
};

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }


// ---- manifest ----------------------------------------------------------------------------------

const std::map<std::string, std::vector<std::string>> kKeys = {
    {"data", {"dir", "train", "reference", "eval"}},
    {"train",
     {"model", "seq_len", "batch_size", "steps", "lr", "min_lr", "warmup_steps", "weight_decay", "grad_clip", "align",
      "eval_every", "eval_tokens", "eval_batch_size", "checkpoint_every", "log_every", "seed", "threads",
      "pool_windows", "stop_after", "fail_rank", "score"}},
    {"reference", {"steps", "lr", "batch_size"}},
    {"axes", {"method", "attention_grad", "filter_ratio"}},
};

class Loader {
 public:
  Loader(std::string path) : path_(std::move(path)) {}

  [[noreturn]] void fail(const std::string& key, const std::string& what) const {
    throw ManifestError(fmt::format("{}: {}: {}", path_, key, what));
  }

  void apply_set(toml::table& root, const std::string& arg, std::vector<std::string>& echo) {
    const auto eq = arg.find('=');
    if (eq == std::string::npos || eq == 0) {
      throw ManifestError(fmt::format("{}: --set '{}': expected key=value (e.g. --set train.steps=40)", path_, arg));
    }
    const std::string key = arg.substr(0, eq), text = arg.substr(eq + 1);
    const auto dot = key.find('.');
    if (dot == std::string::npos || !kKeys.count(key.substr(0, dot))) {
      throw ManifestError(fmt::format("{}: --set '{}': key must be TABLE.KEY with TABLE one of data, train, reference, axes",
                                      path_, arg));
    }
    const std::string tbl = key.substr(0, dot), leaf = key.substr(dot + 1);
    if (!root.contains(tbl)) root.insert(tbl, toml::table{});
    auto* t = root[tbl].as_table();
    if (t == nullptr) {
      throw ManifestError(fmt::format("{}: --set '{}': '{}' is not a table in the manifest (write it as [{}])", path_,
                                      arg, tbl, tbl));
    }
    t->insert_or_assign(leaf, *parse_set_value(text).get("v"));
    echo.push_back(fmt::format("override {} = {} (from --set)", key, text));
  }

  template <typename T>
  void get(const toml::table& t, const std::string& tbl, const std::string& key, T* out) const {
    const toml::node* n = t.get(key);
    if (!n) return;
    const std::string where = tbl + "." + key;
    if constexpr (std::is_same_v<T, std::string>) {
      if (!n->is_string()) fail(where, "must be a string");
      *out = **n->as_string();
    } else if constexpr (std::is_same_v<T, double>) {
      if (auto v = n->value<double>()) *out = *v;
      else fail(where, "must be a number");
    } else {
      if (!n->is_integer()) fail(where, "must be an integer");
      *out = **n->as_integer();
    }
  }

  template <typename T>
  std::vector<T> list(const toml::table& t, const std::string& tbl, const std::string& key,
                      std::vector<T> fallback) const {
    const toml::node* n = t.get(key);
    if (!n) return fallback;
    std::vector<T> out;
    auto one = [&](const toml::node& e) {
      if constexpr (std::is_same_v<T, std::string>) {
        if (!e.is_string()) fail(tbl + "." + key, "must hold strings");
        out.push_back(**e.as_string());
      } else {
        auto v = e.value<double>();
        if (!v) fail(tbl + "." + key, "must hold numbers");
        out.push_back(*v);
      }
    };
    if (auto* a = n->as_array()) {
      for (const auto& e : *a) one(e);
    } else {
      one(*n);
    }
    if (out.empty()) fail(tbl + "." + key, "must not be empty");
    return out;
  }

 private:
  std::string path_;
};

}  // namespace

bool is_training_manifest(const std::string& path) {
  try {
    auto root = toml::parse_file(path);
    return root.contains("train");
  } catch (...) {
    return false;
  }
}

TrainManifest load_train_manifest(const std::string& path, const std::vector<std::string>& sets) {
  TrainManifest m;
  m.path = path;
  toml::table root;
  try {
    root = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    throw ManifestError(fmt::format("{}: TOML error: {}", path, e.description()));
  }
  Loader L(path);
  for (const auto& s : sets) L.apply_set(root, s, m.overrides);
  for (auto&& [k, v] : root) {
    const std::string key(k.str());
    if (key == "name" || key == "description") continue;
    if (!kKeys.count(key)) {
      L.fail(key, "unknown key; allowed: name, description, [data], [train], [reference], [axes]");
    }
    if (!v.is_table()) L.fail(key, "must be a table");
    for (auto&& [k2, v2] : *v.as_table()) {
      const auto& allowed = kKeys.at(key);
      if (std::find(allowed.begin(), allowed.end(), std::string(k2.str())) == allowed.end()) {
        L.fail(key + "." + std::string(k2.str()), fmt::format("unknown key; allowed: {}", fmt::join(allowed, ", ")));
      }
      (void)v2;
    }
  }
  m.name = root["name"].value_or(std::string("train"));
  m.description = root["description"].value_or(std::string());
  auto tbl = [&](const char* n) { return root.contains(n) ? *root[n].as_table() : toml::table{}; };
  const toml::table data = tbl("data"), tr = tbl("train"), ref = tbl("reference"), axes = tbl("axes");
  TrainSettings& s = m.train;
  L.get(data, "data", "dir", &s.data_dir);
  L.get(data, "data", "train", &s.train_split);
  L.get(data, "data", "reference", &s.reference_split);
  s.eval_splits = L.list<std::string>(data, "data", "eval", s.eval_splits);
  L.get(tr, "train", "model", &s.model);
  for (auto [key, ptr] : std::vector<std::pair<const char*, int64_t*>>{
           {"seq_len", &s.seq_len}, {"batch_size", &s.batch_size}, {"steps", &s.steps},
           {"warmup_steps", &s.warmup_steps}, {"align", &s.align}, {"eval_every", &s.eval_every},
           {"eval_tokens", &s.eval_tokens}, {"eval_batch_size", &s.eval_batch_size},
           {"checkpoint_every", &s.checkpoint_every}, {"log_every", &s.log_every}, {"seed", &s.seed},
           {"threads", &s.threads}, {"pool_windows", &s.pool_windows}, {"stop_after", &s.stop_after},
           {"fail_rank", &s.fail_rank}}) {
    L.get(tr, "train", key, ptr);
  }
  for (auto [key, ptr] : std::vector<std::pair<const char*, double*>>{
           {"lr", &s.lr}, {"min_lr", &s.min_lr}, {"weight_decay", &s.weight_decay}, {"grad_clip", &s.grad_clip}}) {
    L.get(tr, "train", key, ptr);
  }
  L.get(tr, "train", "score", &s.score);
  if (s.score != "excess_loss" && s.score != "reference_loss") {
    L.fail("train.score", fmt::format("'{}': allowed excess_loss (RHO-1) or reference_loss", s.score));
  }
  L.get(ref, "reference", "steps", &s.ref_steps);
  L.get(ref, "reference", "batch_size", &s.ref_batch_size);
  L.get(ref, "reference", "lr", &s.ref_lr);
  try {
    (void)models::preset(s.model);
  } catch (const std::invalid_argument& e) {
    L.fail("train.model", e.what());
  }
  auto positive = [&](const char* key, int64_t v) {
    if (v < 1) L.fail(key, fmt::format("{} must be >= 1", v));
  };
  positive("train.seq_len", s.seq_len);
  positive("train.batch_size", s.batch_size);
  positive("train.steps", s.steps);
  positive("train.eval_every", s.eval_every);
  positive("train.eval_tokens", s.eval_tokens);
  positive("train.eval_batch_size", s.eval_batch_size);
  positive("train.checkpoint_every", s.checkpoint_every);
  positive("train.log_every", s.log_every);
  positive("reference.steps", s.ref_steps);
  positive("reference.batch_size", s.ref_batch_size);
  if (s.seq_len > models::preset(s.model).max_position) L.fail("train.seq_len", "exceeds the model's max_position");
  if (!(s.lr > 0 && s.min_lr >= 0 && s.min_lr <= s.lr)) L.fail("train.lr", "need lr > 0 and 0 <= min_lr <= lr");
  if (s.warmup_steps < 0) L.fail("train.warmup_steps", "must be >= 0");
  if (s.pool_windows < 0) L.fail("train.pool_windows", "must be >= 0 (0 = steps x batch_size)");

  const auto methods = L.list<std::string>(axes, "axes", "method", {"regular", "loss_only", "collider"});
  const auto grads = L.list<std::string>(axes, "axes", "attention_grad", {"kept_only", "exact_query"});
  const auto ratios = L.list<double>(axes, "axes", "filter_ratio", {0.4});
  for (const auto& g : grads) {
    if (g != "kept_only" && g != "exact_query") {
      L.fail("axes.attention_grad", fmt::format("'{}' unknown; allowed: kept_only, exact_query", g));
    }
  }
  for (double r : ratios) {
    if (!(r > 0.0 && r < 1.0)) L.fail("axes.filter_ratio", fmt::format("{} outside (0, 1)", r));
  }
  for (const auto& meth : methods) {
    if (meth == "regular") {
      m.points.push_back({"regular", "none", 0.0});
    } else if (meth == "loss_only") {
      for (double r : ratios) m.points.push_back({"loss_only", "none", r});
    } else if (meth == "collider") {
      for (double r : ratios)
        for (const auto& g : grads) m.points.push_back({"collider", g, r});
    } else {
      L.fail("axes.method", fmt::format("'{}' unknown; allowed: regular, loss_only, collider", meth));
    }
  }
  std::ostringstream os;
  os << "# Resolved training manifest: " << path << " with --set overrides, then defaults filled in.\n";
  toml::table res;
  res.insert("name", m.name);
  res.insert("description", m.description);
  toml::array ev;
  for (const auto& e : s.eval_splits) ev.push_back(e);
  res.insert("data", toml::table{{"dir", s.data_dir}, {"train", s.train_split}, {"reference", s.reference_split},
                                 {"eval", ev}});
  res.insert("train", toml::table{{"model", s.model}, {"seq_len", s.seq_len}, {"batch_size", s.batch_size},
                                  {"steps", s.steps}, {"lr", s.lr}, {"min_lr", s.min_lr},
                                  {"warmup_steps", s.warmup_steps}, {"weight_decay", s.weight_decay},
                                  {"grad_clip", s.grad_clip}, {"align", s.align}, {"eval_every", s.eval_every},
                                  {"eval_tokens", s.eval_tokens}, {"eval_batch_size", s.eval_batch_size},
                                  {"checkpoint_every", s.checkpoint_every}, {"log_every", s.log_every},
                                  {"seed", s.seed}, {"threads", s.threads}, {"pool_windows", s.pool_windows},
                                  {"score", s.score}});
  res.insert("reference", toml::table{{"steps", s.ref_steps}, {"lr", s.ref_lr}, {"batch_size", s.ref_batch_size}});
  toml::array am, ag, ar;
  for (const auto& x : methods) am.push_back(x);
  for (const auto& x : grads) ag.push_back(x);
  for (double x : ratios) ar.push_back(x);
  res.insert("axes", toml::table{{"method", am}, {"attention_grad", ag}, {"filter_ratio", ar}});
  os << res << "\n";
  m.resolved_toml = os.str();
  return m;
}

namespace {

// ---- one training run ------------------------------------------------------------------------

struct RunState {
  int64_t step = 0;  // optimizer steps done
  double elapsed_s = 0.0, tokens_seen = 0.0, tokens_backprop = 0.0;
  // The training-loss sums since the last logged step: kept in the checkpoint so that a resumed
  // run logs the same means as an uninterrupted one when checkpoint_every is not a multiple of
  // log_every.
  double log_loss_sum = 0.0, log_kept_sum = 0.0;
  int64_t log_steps = 0;
  nlohmann::json to_json() const {
    return {{"step", step}, {"elapsed_s", elapsed_s}, {"tokens_seen", tokens_seen}, {"tokens_backprop", tokens_backprop},
            {"log_loss_sum", log_loss_sum}, {"log_kept_sum", log_kept_sum}, {"log_steps", log_steps}};
  }
  static RunState from_json(const nlohmann::json& j) {
    RunState s;
    s.step = j.at("step").get<int64_t>();
    s.elapsed_s = j.at("elapsed_s").get<double>();
    s.tokens_seen = j.at("tokens_seen").get<double>();
    s.tokens_backprop = j.at("tokens_backprop").get<double>();
    s.log_loss_sum = j.value("log_loss_sum", 0.0);  // absent in checkpoints of earlier versions
    s.log_kept_sum = j.value("log_kept_sum", 0.0);
    s.log_steps = j.value("log_steps", int64_t{0});
    return s;
  }
};

struct EvalSet {
  std::string name;
  std::shared_ptr<TokenShard> shard;
  int64_t windows = 0;
};

struct RunSpec {
  std::string label;  // progress-line prefix
  StepConfig step_cfg;
  const WindowLoader* loader = nullptr;
  const RefLosses* ref = nullptr;
  int64_t steps = 0, warmup_steps = 0;
  double lr = 0, min_lr = 0;
  std::string ckpt_dir;
  bool resume = false;
  bool may_stop = false;  // honours train.stop_after (training points, not the reference stage)
  ProcessGroup* dist = nullptr;  // data-parallel: the trainer has a GradientReducer on it
};

// Rank 0's value on every rank (a decision only rank 0 can make, e.g. from files only it reads);
// without a process group the value itself.
int64_t from_rank0(ProcessGroup* pg, int64_t value, const char* what) {
  if (pg == nullptr) return value;
  std::vector<torch::Tensor> t = {torch::full({1}, value, torch::kInt64)};
  pg->broadcast(t, 0, what);
  return t[0].item<int64_t>();
}

std::string from_rank0(ProcessGroup* pg, const std::string& value, const char* what) {
  if (pg == nullptr) return value;
  const int64_t n = from_rank0(pg, static_cast<int64_t>(value.size()), what);
  auto bytes = torch::zeros({std::max<int64_t>(n, 1)}, torch::kUInt8);
  if (pg->rank() == 0) std::memcpy(bytes.data_ptr<uint8_t>(), value.data(), value.size());
  std::vector<torch::Tensor> t = {bytes};
  pg->broadcast(t, 0, what);
  return std::string(reinterpret_cast<const char*>(t[0].data_ptr<uint8_t>()), static_cast<size_t>(n));
}

double lr_at(int64_t step, const RunSpec& r) {
  if (step < r.warmup_steps) return r.lr * static_cast<double>(step + 1) / static_cast<double>(r.warmup_steps);
  const double span = std::max<int64_t>(1, r.steps - r.warmup_steps);
  const double t = std::min(1.0, static_cast<double>(step - r.warmup_steps) / span);
  return r.min_lr + 0.5 * (r.lr - r.min_lr) * (1.0 + std::cos(M_PI * t));
}

// A checkpoint directory is complete when its trainer_state.json (written last) exists.
bool checkpoint_complete(const std::string& dir) { return fsutil::exists(fsutil::join(dir, "trainer_state.json")); }

// Checkpoints are replaced by renames only: the new one is written whole into DIR.tmp, the old
// one is moved to DIR.old, the new one renamed to DIR, and DIR.old removed. Whenever a process
// is killed, one complete checkpoint remains under one of these names; recover_checkpoint (at
// resume) puts it back at DIR. (Removing DIR in place could leave a half-deleted directory
// whose trainer_state.json still exists.)
void save_checkpoint(const std::string& dir, Trainer& tr, const RunState& st) {
  const std::string tmp = dir + ".tmp", old = dir + ".old";
  fsutil::remove_tree(tmp);
  models::save_training_checkpoint(tmp, tr.model(), models::adamw_state_tensors(tr.optimizer(), *tr.model()),
                                   st.to_json());
  if (fsutil::exists(dir)) {
    fsutil::remove_tree(old);
    fsutil::rename_path(dir, old);
  }
  fault::hit("checkpoint_swap");  // tests: killed between the two renames
  fsutil::rename_path(tmp, dir);
  fsutil::sync_directory(fsutil::parent_dir(dir));
  fsutil::remove_tree(old);
}

// After a kill: the newest complete checkpoint of DIR, DIR.tmp (written, not yet renamed in) and
// DIR.old (moved aside) goes back to DIR; the leftovers are removed.
void recover_checkpoint(const std::string& dir) {
  const std::string tmp = dir + ".tmp", old = dir + ".old";
  if (!checkpoint_complete(dir)) {
    // DIR is only ever created by renaming a complete checkpoint to it, so an incomplete DIR is a
    // leftover of an earlier version of this code: drop it.
    fsutil::remove_tree(dir);
    if (checkpoint_complete(tmp)) {
      fsutil::rename_path(tmp, dir);
    } else if (checkpoint_complete(old)) {
      fsutil::rename_path(old, dir);
    }
  }
  fsutil::remove_tree(tmp);
  fsutil::remove_tree(old);
}

// A finished run's checkpoint is moved to DIR.done and then removed, so that a kill half-way
// through the removal never leaves a half-deleted directory under a name resume would read.
void remove_checkpoint(const std::string& dir) {
  const std::string done = dir + ".done";
  fsutil::remove_tree(done);
  if (fsutil::exists(dir)) fsutil::rename_path(dir, done);
  fsutil::remove_tree(done);
  fsutil::remove_tree(dir + ".tmp");
  fsutil::remove_tree(dir + ".old");
}

// Trains `spec.steps` steps from the checkpoint if one exists (resume) or from scratch; calls
// on_log(state, train_loss, train_loss_kept, lr) every log_every-th step (means since the last
// call; train_loss over every token, train_loss_kept over the back-propagated ones) and
// on_eval(state, lr) every eval_every-th step; both also at the last step.
void train_loop(const TrainSettings& s, RunSpec spec, Trainer& tr,
                const std::function<void(const RunState&, double, double, double)>& on_log,
                const std::function<void(const RunState&, double)>& on_eval, std::ostream& log) {
  RunState st;
  // Rank 0 puts the newest complete checkpoint back in place after a kill; every rank then resumes
  // from it when rank 0 sees one.
  if (spec.resume && (spec.dist == nullptr || spec.dist->rank() == 0)) recover_checkpoint(spec.ckpt_dir);
  const bool have_ckpt = from_rank0(spec.dist,
                                    spec.resume && fsutil::exists(fsutil::join(spec.ckpt_dir, "trainer_state.json")),
                                    "whether a checkpoint exists") != 0;
  if (have_ckpt) {
    auto ts = models::load_training_checkpoint(spec.ckpt_dir, tr.model());
    models::restore_adamw_state(tr.optimizer(), *tr.model(), ts.optimizer_state);
    st = RunState::from_json(ts.trainer_state);
    log << fmt::format("{} resumed at step {} from {}\n", spec.label, st.step, spec.ckpt_dir);
  }
  // The checkpoint holds the sum over all ranks: rank 0 carries it on, the others start from 0.
  double loss_sum = spec.dist && spec.dist->rank() != 0 ? 0.0 : st.log_loss_sum, kept_sum = st.log_kept_sum;
  int64_t loss_n = st.log_steps;
  const int64_t first = st.step;
  const double elapsed_at_start = st.elapsed_s;
  while (st.step < spec.steps) {
    const auto t0 = Clock::now();
    const double lr = lr_at(st.step, spec);
    for (auto& g : tr.optimizer().param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
    const auto windows = spec.loader->window_ids(st.step);
    Batch b = spec.loader->batch_of(windows);
    if (spec.ref) b.ref_loss_BT = spec.ref->rows(windows);
    if (spec.may_stop && st.step == 2 && s.fail_rank == (spec.dist ? spec.dist->rank() : 0)) {
      throw std::runtime_error(fmt::format("train.fail_rank = {} (tests): this rank fails at step 2", s.fail_rank));
    }
    const StepResult r = tr.step(b);
    if (!std::isfinite(r.loss)) {
      throw std::runtime_error(fmt::format("{}: loss is {} at step {}", spec.label, r.loss, st.step));
    }
    st.step += 1;
    st.elapsed_s += seconds_since(t0);
    st.tokens_seen += static_cast<double>(r.tokens);
    st.tokens_backprop += static_cast<double>(r.tokens_kept);
    // r.loss (kept) and the token counts are over every rank already; loss_all is this rank's:
    // its share of the global mean, summed over ranks when logged.
    loss_sum += spec.dist ? r.loss_all * static_cast<double>(b.input_ids_BT.numel()) / static_cast<double>(r.tokens)
                          : r.loss_all;
    kept_sum += r.loss;
    loss_n += 1;
    const double per_step = (st.elapsed_s - elapsed_at_start) / static_cast<double>(st.step - first);
    if (st.step % s.log_every == 0 || st.step == spec.steps) {
      if (spec.dist) {
        std::vector<torch::Tensor> t = {torch::full({1}, loss_sum, torch::kFloat64)};
        spec.dist->all_reduce_sum(t, "the training loss over ranks");
        loss_sum = t[0].item<double>();
      }
      const double mean = loss_sum / static_cast<double>(loss_n), kept = kept_sum / static_cast<double>(loss_n);
      log << fmt::format("{} step {}/{} loss {:.4f} (kept {:.4f}) lr {:.2e} {:.2f} s/step elapsed {} ETA {}\n",
                         spec.label, st.step, spec.steps, mean, kept, lr, per_step, hms(st.elapsed_s),
                         hms(per_step * static_cast<double>(spec.steps - st.step)))
          << std::flush;
      on_log(st, mean, kept, lr);
      loss_sum = kept_sum = 0;
      loss_n = 0;
    }
    // Rank 0 evaluates (every replica holds the same parameters) while the others wait.
    if (st.step % s.eval_every == 0 || st.step == spec.steps) run_on_rank0(spec.dist, [&] { on_eval(st, lr); });
    if (st.step % s.checkpoint_every == 0 && st.step < spec.steps) {
      st.log_loss_sum = loss_sum;  // this rank's share: the checkpoint keeps the sum over ranks
      if (spec.dist) {
        std::vector<torch::Tensor> t = {torch::full({1}, loss_sum, torch::kFloat64)};
        spec.dist->all_reduce_sum(t, "the training loss over ranks (checkpoint)");
        st.log_loss_sum = t[0].item<double>();
      }
      st.log_kept_sum = kept_sum;
      st.log_steps = loss_n;
      run_on_rank0(spec.dist, [&] { save_checkpoint(spec.ckpt_dir, tr, st); });
      if (spec.may_stop && st.step == s.stop_after) {
        throw SimulatedKill();
      }
    }
  }
}

std::string fmt_num(double v) { return fmt::format("{}", v); }

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
    out << fmt::format("{}: training manifest, {} runs of {} steps x {} x {} tokens ({} tokens each), seed {}; "
                       "reference {} steps on {}; data {}\n",
                       m.name, m.points.size(), s.steps, s.batch_size, s.seq_len, s.steps * s.batch_size * s.seq_len,
                       s.seed, s.ref_steps, s.reference_split, data_dir);
    for (size_t i = 0; i < m.points.size(); ++i) out << fmt::format("{:>4}  {}\n", i + 1, m.points[i].id(s));
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
    const ExistingResults& existing = run_dir.existing();
    run_dir.write_records(m.resolved_toml, prov, dist, log);
    log << fmt::format("collider run: {} ({} training runs, {} steps each{}) -> {}\n", m.name, m.points.size(),
                       s.steps, dist ? fmt::format(", {} ranks x batch {}", world, s.batch_size) : "", out_dir);

    // Data.
    auto shard = [&](const std::string& split) {
      return std::make_shared<TokenShard>(fsutil::join(data_dir, split + ".bin"));
    };
    auto train_shard = shard(s.train_split);
    auto ref_shard = shard(s.reference_split);
    const auto& cfg = models::preset(s.model);
    if (train_shard->header().vocab_size > static_cast<uint32_t>(cfg.vocab_size)) {
      throw std::runtime_error(fmt::format("the tokenizer of {} has {} pieces but {} has vocab_size {}", data_dir,
                                           train_shard->header().vocab_size, s.model, cfg.vocab_size));
    }
    std::vector<EvalSet> evals;
    for (const auto& e : s.eval_splits) {
      auto sh = shard(e);
      const int64_t w = std::min((sh->size() - 1) / s.seq_len, std::max<int64_t>(1, s.eval_tokens / s.seq_len));
      evals.push_back({e, sh, w});
    }
    auto evaluate = [&](models::CausalLM& model) {
      std::vector<std::pair<std::string, double>> r;
      for (const auto& e : evals) {
        r.emplace_back(e.name, mean_window_loss(model, *e.shard, s.seq_len, e.windows, s.eval_batch_size));
      }
      return r;
    };

    // Reference stage: train (regular) on the curated split, then score the training pool once.
    const std::string ref_tag = fmt::format("{}-T{}-B{}-s{}-lr{}-seed{}", s.model, s.seq_len, s.ref_batch_size,
                                            s.ref_steps, s.ref_lr, s.seed);
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
          StepConfig sc;
          sc.method = Method::kRegular;
          sc.weight_decay = s.weight_decay;
          sc.grad_clip = s.grad_clip;
          Trainer tr(ref_model, sc, device, s.seed);
          WindowLoader loader(ref_shard, s.seq_len, s.ref_batch_size, static_cast<uint64_t>(s.seed) + 1000);
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
          train_loop(s, spec, tr, [](const RunState&, double, double, double) {},
                     [&](const RunState& st, double) {
                       nlohmann::json e = {{"step", st.step}, {"elapsed_s", st.elapsed_s}};
                       for (const auto& [name, loss] : evaluate(tr.model())) {
                         e[name] = loss;
                         log << fmt::format("{} step {} eval {} loss {:.4f} ppl {:.2f}\n", spec.label, st.step, name,
                                            loss, std::exp(loss));
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
        compute_ref_losses(ref_model, *train_shard, s.seq_len, pool, s.eval_batch_size, ref_losses_path, &log);
        log << fmt::format("reference: scored in {:.1f} s\n", seconds_since(t0));
      } else {
        log << "reference: losses from " << ref_losses_path << "\n";
      }
    });
    RefLosses ref_losses(ref_losses_path);
    if (ref_losses.shard_tokens() != train_shard->size() || ref_losses.seq_len() != s.seq_len ||
        ref_losses.num_windows() < pool) {
      throw std::runtime_error(fmt::format("{} does not match the shard {} (delete it to recompute)", ref_losses_path,
                                           train_shard->path()));
    }
    if (writer && fsutil::exists(fsutil::join(ref_dir, "reference.json"))) {
      fsutil::write_file_atomic(fsutil::join(out_dir, "reference.json"),
                                fsutil::read_file(fsutil::join(ref_dir, "reference.json")));
    }

    // Training runs.
    // Rank r takes windows [r*B, (r+1)*B) of each step's global batch of world_size x B.
    WindowLoader loader(train_shard, s.seq_len, s.batch_size, static_cast<uint64_t>(s.seed), pool, rank, world);
    std::unique_ptr<JsonlWriter> rows = run_dir.open_rows();
    // Rank 0's view (it read the rows); every rank skips the same runs. A run is finished when every
    // eval set has its final row (a kill between two of them leaves it unfinished).
    std::map<std::string, std::set<std::string>> final_sets;
    // Rows already in the file, by (point, step, eval set): a run resumed from a checkpoint older
    // than its last rows recomputes those steps and does not write them again.
    std::set<std::string> written;
    auto row_key = [](const std::string& pid, int64_t step, const std::string& eval_set) {
      return fmt::format("{}|{}|{}", pid, step, eval_set);
    };
    for (const auto& row : existing.rows) {
      if (row.value("status", "") != "ok" || !row.contains("step") || !row["step"].is_number_integer()) continue;
      const std::string pid = row.value("point_id", "");
      const std::string set = row.contains("eval_set") && row["eval_set"].is_string() ? row["eval_set"].get<std::string>() : "";
      written.insert(row_key(pid, row["step"].get<int64_t>(), set));
      if (row.value("final", false) && !set.empty()) final_sets[pid].insert(set);
    }
    std::set<std::string> done;
    for (const auto& [pid, sets_done] : final_sets) {
      bool all = true;
      for (const auto& e : s.eval_splits) all = all && sets_done.count(e) > 0;
      if (all) done.insert(pid);
    }
    int64_t failed = 0;
    const auto t_all = Clock::now();
    for (size_t i = 0; i < m.points.size(); ++i) {
      const TrainPoint& p = m.points[i];
      const std::string pid = p.id(s);
      std::string slug = pid;
      for (char& c : slug) c = c == '/' ? '_' : c;
      const std::string ckpt_dir = fsutil::join(fsutil::join(out_dir, "checkpoints"), slug);
      if (from_rank0(dist, done.count(pid), "whether a run is finished") != 0) {
        log << fmt::format("[{}/{}] {}: already finished (resume)\n", i + 1, m.points.size(), pid);
        if (writer) remove_checkpoint(ckpt_dir);  // left by a kill after its last rows
        continue;
      }
      nlohmann::json base = {{"experiment", m.name}, {"point_id", pid}, {"status", "ok"}, {"error", nullptr},
                             {"model", s.model}, {"seq_len", s.seq_len}, {"batch_size", s.batch_size},
                             {"filter_ratio", p.filter_ratio}, {"method", p.method},
                             {"attention_grad", p.attention_grad}, {"dtype", "fp32"}, {"device", "cpu"},
                             {"seed", s.seed}, {"steps_total", s.steps}, {"num_params", cfg.num_params()},
                             {"score", p.method == "regular" ? "none" : s.score}, {"reference", ref_tag},
                             {"data_dir", data_dir}, {"train_split", s.train_split}, {"scale", "cpu"},
                             {"world_size", world}, {"global_batch_size", world * s.batch_size}};
      const nlohmann::json pj = to_json(prov);
      for (auto it = pj.begin(); it != pj.end(); ++it) base[it.key()] = it.value();
      try {
        StepConfig sc;
        sc.method = method_from_string(p.method);
        sc.filter_ratio = p.filter_ratio;
        sc.attention_grad =
            p.attention_grad == "exact_query" ? collider::AttentionGrad::kExactQuery : collider::AttentionGrad::kKeptOnly;
        sc.align = s.align;
        sc.weight_decay = s.weight_decay;
        sc.grad_clip = s.grad_clip;
        sc.score = p.method == "regular" ? "self" : s.score == "excess_loss" ? "reference" : "reference_only";
        Trainer tr(models::build_model(cfg, models::AttentionImpl::kEager, s.seed), sc, device, s.seed);
        if (dist) tr.set_reducer(std::make_shared<GradientReducer>(dist_ptr, tr.model()->parameters()));
        RunSpec spec;
        spec.label = fmt::format("[{}/{} {} {}{}]", i + 1, m.points.size(), p.method,
                                 p.method == "collider" ? p.attention_grad + " " : "", fmt_num(p.filter_ratio));
        spec.step_cfg = sc;
        spec.loader = &loader;
        spec.ref = p.method == "regular" ? nullptr : &ref_losses;
        spec.steps = s.steps;
        spec.warmup_steps = s.warmup_steps;
        spec.lr = s.lr;
        spec.min_lr = s.min_lr;
        spec.ckpt_dir = ckpt_dir;
        spec.resume = resume;
        spec.may_stop = true;
        spec.dist = dist;
        auto progress = [&](nlohmann::json& row, const RunState& st, double lr) {
          row["step"] = st.step;
          row["elapsed_s"] = st.elapsed_s;
          row["tokens_seen"] = st.tokens_seen;
          row["tokens_backprop"] = st.tokens_backprop;
          row["lr"] = lr;
          row["final"] = st.step == s.steps;
          row["timestamp"] = utc_timestamp();
        };
        train_loop(s, spec, tr,
                   [&](const RunState& st, double train_loss, double train_loss_kept, double lr) {
                     if (!rows || written.count(row_key(pid, st.step, ""))) return;
                     nlohmann::json row = base;  // a training-loss row (no eval_set)
                     progress(row, st, lr);
                     row["final"] = false;  // the eval rows of the last step mark the run finished
                     row["train_loss"] = train_loss;
                     row["train_loss_kept"] = train_loss_kept;
                     row["eval_set"] = nullptr;
                     rows->append(row);
                   },
                   [&](const RunState& st, double lr) {
                     const auto te = Clock::now();
                     const auto ev = evaluate(tr.model());
                     const double eval_s = seconds_since(te);
                     for (const auto& [name, loss] : ev) {
                       if (written.count(row_key(pid, st.step, name))) continue;  // written before a kill
                       nlohmann::json row = base;
                       progress(row, st, lr);
                       row["eval_set"] = name;
                       row["val_loss"] = loss;
                       row["val_ppl"] = std::exp(loss);
                       row["eval_tokens"] = evals.front().windows * s.seq_len;
                       row["eval_s"] = eval_s;
                       rows->append(row);  // on_eval runs on rank 0 only
                       log << fmt::format("{} step {} eval {} loss {:.4f} ppl {:.2f}\n", spec.label, st.step, name,
                                          loss, std::exp(loss));
                     }
                   },
                   log);
        if (writer) remove_checkpoint(spec.ckpt_dir);  // finished: the rows hold the result
        log << fmt::format("[{}/{}] {} done; all runs so far {}\n", i + 1, m.points.size(), pid,
                           hms(seconds_since(t_all)));
      } catch (const SimulatedKill&) {
        throw;
      } catch (const DistributedError&) {
        throw;
      } catch (const fsutil::WriteError&) {
        throw;  // no space or no permission: the next run would fail the same way; end here
      } catch (const std::exception& e) {
        failed += 1;
        nlohmann::json row = base;
        row["status"] = "error";
        row["error"] = e.what();
        row["step"] = 0;
        row["timestamp"] = utc_timestamp();
        if (rows) rows->append(row);
        err << fmt::format("{}[{}/{}] {}: error: {}\n", rank_tag, i + 1, m.points.size(), pid, e.what());
        if (dist) {
          // The other ranks may be inside a collective of this run: stop (exiting closes this rank's
          // connections, so they fail fast instead of running mismatched collectives).
          throw DistributedError(fmt::format("{}training run {} failed ({}); a data-parallel run stops at the first "
                                             "failing run",
                                             rank_tag, pid, e.what()));
        }
      }
    }
    if (writer) ::rmdir(fsutil::join(out_dir, "checkpoints").c_str());  // only when empty: every run finished
    log << fmt::format("collider run: {} runs, {} failed; rows in {}\n", m.points.size(), failed, results_path);
    return failed > 0 ? 1 : 0;
  } catch (...) {
    return run_failure_status(err, rank_tag, std::current_exception());
  }
}

}  // namespace collider::harness
