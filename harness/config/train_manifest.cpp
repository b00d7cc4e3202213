// The training-manifest schema (train_manifest.h) on the shared loader (loader.h): its keys
// with their built-in defaults (TrainSettings), the validator, the runs (one per method, ratio
// and attention_grad; forward_drop per ratio) and the resolved manifest.
#include "harness/config/train_manifest.h"

#include "models/model_config.h"

#include <fmt/format.h>
#include <toml++/toml.h>

#include <sstream>

namespace collider::harness {

using models::Method;
using models::MethodSpec;
using models::Score;

std::string TrainPoint::id(const TrainSettings& s) const {
  // per_sequence points keep the ids they had before the selection axis existed (resume finds them).
  return fmt::format("{}/T{}/B{}/f{}/{}/{}{}", s.model, s.seq_len, s.batch_size, filter_ratio, to_string(spec.method),
                     models::attention_grad_name(spec),
                     spec.policy == collider::SelectPolicy::kBatchTopK ? "/batch_topk" : "");
}

bool is_training_manifest(const std::string& path) {
  try {
    auto root = toml::parse_file(path);
    return root.contains("train");
  } catch (...) { return false; }
}

namespace {

// The axes of a training manifest as written, with their defaults.
struct TrainAxes {
  std::vector<std::string> methods = {"regular", "loss_only", "collider"};
  std::vector<std::string> grads = {"kept_only", "exact_query"};
  std::vector<double> ratios = {0.4};
  std::vector<std::string> selections = {"per_sequence"};
};

// Every key of the schema, bound to its field (the loader applies the file and --set to them).
void declare_keys(Loader& L, TrainManifest& m, TrainAxes& axes) {
  TrainSettings& s = m.train;
  L.add("name", &m.name);
  L.add("description", &m.description);
  L.add_section("data", "dir");
  L.add("data.dir", &s.data_dir);
  L.add("data.train", &s.train_split);
  L.add("data.reference", &s.reference_split);
  L.add("data.eval", &s.eval_splits);
  L.add_section("train", "steps");
  L.add("train.model", &s.model);
  L.add("train.seq_len", &s.seq_len);
  L.add("train.batch_size", &s.batch_size);
  L.add("train.steps", &s.steps);
  L.add("train.lr", &s.lr);
  L.add("train.min_lr", &s.min_lr);
  L.add("train.warmup_steps", &s.warmup_steps);
  L.add("train.weight_decay", &s.weight_decay);
  L.add("train.grad_clip", &s.grad_clip);
  L.add("train.align", &s.align);
  L.add("train.head", &s.head);
  L.add("train.eval_every", &s.eval_every);
  L.add("train.eval_tokens", &s.eval_tokens);
  L.add("train.eval_batch_size", &s.eval_batch_size);
  L.add("train.checkpoint_every", &s.checkpoint_every);
  L.add("train.log_every", &s.log_every);
  L.add("train.seed", &s.seed);
  L.add("train.threads", &s.threads);
  L.add("train.pool_windows", &s.pool_windows);
  L.add("train.score", &s.score);
  L.add("train.stop_after", &s.stop_after, /*advertised=*/false);  // tests
  L.add("train.fail_rank", &s.fail_rank, /*advertised=*/false);    // tests
  L.add_section("reference", "steps");
  L.add("reference.steps", &s.ref_steps);
  L.add("reference.lr", &s.ref_lr);
  L.add("reference.batch_size", &s.ref_batch_size);
  L.add_section("axes", "method");
  L.add("axes.method", &axes.methods);
  L.add("axes.attention_grad", &axes.grads);
  L.add("axes.filter_ratio", &axes.ratios);
  L.add("axes.selection", &axes.selections);
}

// The settings' ranges: throws ManifestError naming the key, its value and what is allowed.
void check_settings(const Loader& L, const TrainSettings& s) {
  int64_t max_position = 0;
  try {
    max_position = models::preset(s.model).max_position;
  } catch (const std::invalid_argument& e) {
    throw ManifestError(fmt::format("{}: key 'train.model' = \"{}\": {}", L.source("train.model"), s.model, e.what()));
  }
  for (auto [key, v] : std::vector<std::pair<const char*, int64_t>>{{"train.seq_len", s.seq_len},
                                                                    {"train.batch_size", s.batch_size},
                                                                    {"train.steps", s.steps},
                                                                    {"train.eval_every", s.eval_every},
                                                                    {"train.eval_tokens", s.eval_tokens},
                                                                    {"train.eval_batch_size", s.eval_batch_size},
                                                                    {"train.checkpoint_every", s.checkpoint_every},
                                                                    {"train.log_every", s.log_every},
                                                                    {"reference.steps", s.ref_steps},
                                                                    {"reference.batch_size", s.ref_batch_size}}) {
    L.check(v >= 1, key, std::to_string(v), "an integer >= 1");
  }
  if (s.seq_len > max_position) {
    throw ManifestError(fmt::format("{}: key 'train.seq_len' = {} exceeds the maximum position {} of model '{}'",
                                    L.source("train.seq_len"), s.seq_len, max_position, s.model));
  }
  L.check(s.lr > 0, "train.lr", fmt::format("{}", s.lr), "a number > 0");
  L.check(s.min_lr >= 0 && s.min_lr <= s.lr, "train.min_lr", fmt::format("{}", s.min_lr),
          fmt::format("a number in [0, train.lr = {}]", s.lr));
  L.check(s.align >= 1, "train.align", std::to_string(s.align), "an integer >= 1");
  L.check_in("train.head", s.head, {"dense", "fused"});
  L.check(s.warmup_steps >= 0, "train.warmup_steps", std::to_string(s.warmup_steps), "an integer >= 0");
  L.check(s.pool_windows >= 0, "train.pool_windows", std::to_string(s.pool_windows),
          "an integer >= 0 (0 = steps x batch_size)");
}

// forward_drop's runs, one per ratio: its first and last layer see every token, so it needs 3
// layers, and each ratio must leave its middle layers a token.
void add_forward_drop_points(const Loader& L, const TrainSettings& s, const std::vector<double>& ratios,
                             std::vector<TrainPoint>& points) {
  const int64_t num_layers = models::preset(s.model).num_layers;
  if (num_layers < 3) {
    throw ManifestError(fmt::format(
        "{}: key 'axes.method' = \"forward_drop\" needs a model with at least 3 decoder layers (the first and "
        "the last see every token); train.model '{}' has {}: use a preset with more layers or drop forward_drop",
        L.source("axes.method"), s.model, num_layers));
  }
  for (double r : ratios) {
    if (collider::kept_count(s.seq_len, r, s.align) < 1) {
      throw ManifestError(
          fmt::format("{}: key 'axes.filter_ratio' = {} leaves forward_drop's middle layers no token of seq_len "
                      "{} with align {}; lower the ratio or train.align, or raise train.seq_len",
                      L.source("axes.filter_ratio"), r, s.seq_len, s.align));
    }
    points.push_back({MethodSpec{Method::kForwardDrop}, r});
  }
}

// The runs: regular once; loss_only per ratio and selection; forward_drop per ratio; collider per
// ratio, attention_grad and selection.
std::vector<TrainPoint> train_points(const Loader& L, const TrainSettings& s, const TrainAxes& axes, Score score) {
  std::vector<collider::AttentionGrad> attention_grads;
  for (const auto& g : axes.grads) {
    attention_grads.push_back(
        L.parse_in("axes.attention_grad", g, models::attention_grad_names(), &collider::attention_grad_from_string));
  }
  std::vector<collider::SelectPolicy> policies;
  for (const auto& p : axes.selections) {
    policies.push_back(L.parse_in("axes.selection", p, models::policy_names(), &collider::select_policy_from_string));
  }
  L.check_unique("axes.selection", axes.selections);
  for (double r : axes.ratios) {
    L.check(r > 0.0 && r < 1.0, "axes.filter_ratio", fmt::format("{}", r),
            "(0, 1): the fraction of tokens dropped (regular runs once, unfiltered)");
  }
  std::vector<TrainPoint> points;
  for (const auto& name : axes.methods) {
    const Method method = L.parse_in("axes.method", name,
                                     {to_string(Method::kRegular), to_string(Method::kLossOnly),
                                      to_string(Method::kCollider), to_string(Method::kForwardDrop)},
                                     &models::method_from_string);
    if (method == Method::kRegular) {
      points.push_back({MethodSpec{Method::kRegular}, 0.0});
    } else if (method == Method::kLossOnly) {
      for (double r : axes.ratios)
        for (collider::SelectPolicy p : policies) points.push_back({MethodSpec{Method::kLossOnly, {}, p, score}, r});
    } else if (method == Method::kForwardDrop) {
      add_forward_drop_points(L, s, axes.ratios, points);
    } else {
      for (double r : axes.ratios)
        for (collider::AttentionGrad g : attention_grads)
          for (collider::SelectPolicy p : policies) points.push_back({MethodSpec{Method::kCollider, g, p, score}, r});
    }
  }
  return points;
}

}  // namespace

TrainManifest load_train_manifest(const std::string& path, const std::vector<std::string>& sets) {
  TrainManifest m;
  m.path = path;
  m.name = "train";
  TrainAxes axes;
  Loader L(path, "train.steps=40");
  declare_keys(L, m, axes);
  L.apply(parse_manifest_toml(read_manifest_file(path), path), sets);
  m.overrides = L.overrides();
  // Selection score of loss_only and collider (regular and forward_drop select nothing).
  const Score score =
      L.parse_in("train.score", m.train.score, {to_string(Score::kExcessLoss), to_string(Score::kReferenceLoss)},
                 &models::score_from_string);
  check_settings(L, m.train);
  m.points = train_points(L, m.train, axes, score);

  std::ostringstream os;
  os << "# Resolved training manifest: " << path << " with --set overrides, then defaults filled in.\n";
  const toml::table res = L.resolved_table();
  os << res << "\n";
  m.resolved_toml = os.str();
  return m;
}

}  // namespace collider::harness
