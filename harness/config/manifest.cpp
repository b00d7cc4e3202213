// The timing-manifest schema (manifest.h) on the shared loader (loader.h): its keys with their
// built-in defaults, the validator, the sweep expansion with [[exclude]] and the resolved
// manifest. Values flow: built-in RunSettings / axes defaults -> the file's keys -> --set keys.
#include "harness/config/manifest.h"

#include "harness/config/loader.h"
#include "models/model_config.h"

#include <collider/select.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <toml++/toml.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <sstream>

namespace collider::harness {
namespace {

using models::Method;
using models::MethodSpec;
using models::Score;
using models::method_from_string;
using models::uses_attention_grad;

std::string fmt_ratio(double r) { return fmt::format("{}", r); }

const std::vector<std::string> kAxisKeys = {"model",  "seq_len",        "batch_size", "filter_ratio",
                                            "method", "attention_grad", "selection"};

struct Axes {
  std::vector<std::string> model = {"tinyllama-mini"};
  std::vector<int64_t> seq_len = {512};
  std::vector<int64_t> batch_size = {1};
  std::vector<double> filter_ratio = {0.0};
  std::vector<std::string> method = {"regular"};
  std::vector<std::string> attention_grad = {"kept_only"};
  std::vector<std::string> selection = {"per_sequence"};  // [run.selection] unless given
};

struct Exclude {
  std::map<std::string, std::vector<std::string>> values;  // axis -> canonical values (any of)
  std::string where;
};

class TimingSchema {
 public:
  TimingSchema(std::string path, bool check_device)
      : path_(std::move(path)), check_device_(check_device), L_(path_, "run.measure_steps=10") {
    m_.path = path_;
    auto& r = m_.run;
    L_.add("name", &m_.name);
    L_.add("description", &m_.description);
    L_.add_section("run", "seed");
    L_.add("run.device", &r.device);
    L_.add("run.dtype", &r.dtype);
    L_.add("run.warmup_steps", &r.warmup_steps);
    L_.add("run.measure_steps", &r.measure_steps);
    L_.add("run.repetitions", &r.repetitions);
    L_.add("run.seed", &r.seed);
    L_.add("run.threads", &r.threads);
    L_.add("run.lr", &r.lr);
    L_.add("run.weight_decay", &r.weight_decay);
    L_.add("run.beta1", &r.beta1);
    L_.add("run.beta2", &r.beta2);
    L_.add("run.eps", &r.eps);
    L_.add("run.grad_clip", &r.grad_clip);
    L_.add("run.align", &r.align);
    L_.add("run.selection", &r.selection);
    L_.add("run.score", &r.score);
    L_.add("run.data", &r.data);
    L_.add("run.reference_losses", &r.reference_losses);
    L_.add("run.attention_impl", &r.attention_impl);
    L_.add("run.head", &r.head);
    L_.add("run.layer_timing", &r.layer_timing);
    L_.add("run.aa_check", &r.aa_check);
    L_.add("run.floor", &r.floor);
    L_.add("run.copy_probe", &r.copy_probe);
    L_.add("run.fail_point", &r.fail_point, /*advertised=*/false);  // tests inject a failure at matching points
    L_.add_section("axes", "method");
    L_.add("axes.model", &axes_.model);
    L_.add("axes.seq_len", &axes_.seq_len);
    L_.add("axes.batch_size", &axes_.batch_size);
    L_.add("axes.filter_ratio", &axes_.filter_ratio);
    L_.add("axes.method", &axes_.method);
    L_.add("axes.attention_grad", &axes_.attention_grad);
    L_.add("axes.selection", &axes_.selection);
    L_.add_custom(
        "exclude", [this](const toml::node& v, const std::string& where) { read_excludes(v, where); },
        "[[exclude]] tables cannot be set from the command line; edit the manifest");
  }

  void apply(const toml::table& root, const std::vector<std::string>& sets) {
    L_.apply(root, sets);
    m_.overrides = L_.overrides();
  }

  Manifest finish(const std::string& default_name) {
    if (m_.name.empty()) m_.name = default_name;
    validate();
    expand();
    m_.resolved_toml = resolved();
    return m_;
  }

 private:
  void read_excludes(const toml::node& v, const std::string& where_file) {
    const auto* arr = v.as_array();
    if (!arr) {
      L_.fail(where_file, "exclude",
              fmt::format("must be an array of tables ([[exclude]]), got {}", toml_type_name(v)));
    }
    int i = 0;
    for (const auto& e : *arr) {
      const auto* t = e.as_table();
      const std::string where = fmt::format("{}: [[exclude]] #{}", where_file, i + 1);
      if (!t) throw ManifestError(fmt::format("{}: must be a table, got {}", where, toml_type_name(e)));
      read_exclude(*t, where);
      ++i;
    }
  }

  void read_exclude(const toml::table& t, const std::string& where) {
    Exclude e;
    e.where = where;
    if (t.empty()) throw ManifestError(fmt::format("{}: an empty exclude table would exclude every point", where));
    for (auto&& [k, v] : t) {
      const std::string key(k.str());
      auto& vals = e.values[key];
      if (key == "model" || key == "method" || key == "attention_grad" || key == "selection") {
        vals = L_.get_list<std::string>(v, key, where);
      } else if (key == "seq_len" || key == "batch_size") {
        for (int64_t x : L_.get_list<int64_t>(v, key, where)) vals.push_back(std::to_string(x));
      } else if (key == "filter_ratio") {
        for (double x : L_.get_list<double>(v, key, where)) vals.push_back(fmt_ratio(x));
      } else {
        L_.fail(where, key,
                fmt::format("is not an axis; an exclude table matches axis values: {}",
                            fmt::format("{}", fmt::join(kAxisKeys, ", "))));
      }
    }
    excludes_.push_back(std::move(e));
  }

  void validate() {
    auto& r = m_.run;
    const bool name_ok = !m_.name.empty() && std::all_of(m_.name.begin(), m_.name.end(), [](char c) {
      return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.';
    });
    if (!name_ok) {
      throw ManifestError(
          fmt::format("{}: key 'name' = \"{}\" must be non-empty letters, digits, '.', '_', '-' "
                      "(it names the results directory)",
                      L_.source("name"), m_.name));
    }
    L_.check_in("run.device", r.device, {"cpu", "cuda", "auto"});
    if (r.device == "auto") r.device = torch::cuda::is_available() ? "cuda" : "cpu";
    if (check_device_ && r.device == "cuda" && !torch::cuda::is_available()) {
      throw ManifestError(
          fmt::format("{}: key 'run.device' = \"cuda\" but no CUDA device is available on this "
                      "machine; allowed here: cpu, auto",
                      L_.source("run.device")));
    }
    L_.check_in("run.dtype", r.dtype, {"fp32", "bf16", "auto"});
    if (r.dtype == "auto") r.dtype = r.device == "cuda" ? "bf16" : "fp32";
    if (r.dtype == "bf16" && r.device != "cuda") {
      throw ManifestError(
          fmt::format("{}: key 'run.dtype' = \"bf16\" needs run.device = cuda (bf16 autocast); on "
                      "cpu the step runs in fp32; allowed: fp32, auto",
                      L_.source("run.dtype")));
    }
    L_.check(r.warmup_steps >= 0, "run.warmup_steps", std::to_string(r.warmup_steps), "an integer >= 0");
    L_.check(r.measure_steps >= 1, "run.measure_steps", std::to_string(r.measure_steps), "an integer >= 1");
    L_.check(r.repetitions >= 1, "run.repetitions", std::to_string(r.repetitions), "an integer >= 1");
    L_.check(r.seed >= 0, "run.seed", std::to_string(r.seed), "an integer >= 0");
    L_.check(r.threads >= 0, "run.threads", std::to_string(r.threads), "an integer >= 0 (0 = torch's default)");
    L_.check(r.lr > 0, "run.lr", fmt::format("{}", r.lr), "a number > 0");
    L_.check(r.weight_decay >= 0, "run.weight_decay", fmt::format("{}", r.weight_decay), "a number >= 0");
    L_.check(r.beta1 >= 0 && r.beta1 < 1, "run.beta1", fmt::format("{}", r.beta1), "[0, 1)");
    L_.check(r.beta2 >= 0 && r.beta2 < 1, "run.beta2", fmt::format("{}", r.beta2), "[0, 1)");
    L_.check(r.eps > 0, "run.eps", fmt::format("{}", r.eps), "a number > 0");
    L_.check(r.grad_clip >= 0, "run.grad_clip", fmt::format("{}", r.grad_clip), "a number >= 0 (0 disables clipping)");
    L_.check(r.align >= 1, "run.align", std::to_string(r.align), "an integer >= 1");
    // The run's selection policies and scores, parsed once; method and attention_grad per point.
    L_.parse_in("run.selection", r.selection, models::policy_names(), &collider::select_policy_from_string);
    if (!L_.given("axes.selection")) axes_.selection = {r.selection};
    for (const auto& s : axes_.selection) {
      policies_.push_back(
          L_.parse_in("axes.selection", s, models::policy_names(), &collider::select_policy_from_string));
    }
    L_.check_unique("axes.selection", axes_.selection);
    spec_.policy = policies_.front();  // what the methods that select nothing carry
    spec_.score = L_.parse_in("run.score", r.score,
                              {to_string(Score::kSelf), to_string(Score::kRandom), to_string(Score::kExcessLoss)},
                              &models::score_from_string);
    check_data();
    L_.check_in("run.attention_impl", r.attention_impl, models::attention_impl_names());
    L_.check_in("run.head", r.head, {"dense", "fused"});

    for (const auto& name : axes_.model) {
      try {
        const auto& cfg = models::preset(name);
        for (int64_t T : axes_.seq_len) {
          if (T > cfg.max_position) {
            throw ManifestError(fmt::format("{}: key 'axes.seq_len' = {} exceeds the maximum position {} of model '{}'",
                                            L_.source("axes.seq_len"), T, cfg.max_position, name));
          }
        }
      } catch (const std::invalid_argument& e) {
        throw ManifestError(fmt::format("{}: key 'axes.model' = \"{}\": {}", L_.source("axes.model"), name, e.what()));
      }
    }
    for (int64_t T : axes_.seq_len) L_.check(T >= 2, "axes.seq_len", std::to_string(T), "integers >= 2");
    for (int64_t B : axes_.batch_size) L_.check(B >= 1, "axes.batch_size", std::to_string(B), "integers >= 1");
    for (double f : axes_.filter_ratio) {
      L_.check(f >= 0.0 && f < 1.0, "axes.filter_ratio", fmt_ratio(f),
               "[0, 1): the fraction of tokens dropped (1.0 would drop every token)");
    }
    for (const auto& m : axes_.method) {
      methods_.push_back(L_.parse_in("axes.method", m, models::method_names(), &method_from_string));
    }
    for (const auto& a : axes_.attention_grad) {
      grads_.push_back(
          L_.parse_in("axes.attention_grad", a, models::attention_grad_names(), &collider::attention_grad_from_string));
    }
    L_.check_unique("axes.model", axes_.model);
    L_.check_unique("axes.seq_len", axes_.seq_len);
    L_.check_unique("axes.batch_size", axes_.batch_size);
    L_.check_unique("axes.filter_ratio", axes_.filter_ratio);
    L_.check_unique("axes.method", axes_.method);
    L_.check_unique("axes.attention_grad", axes_.attention_grad);

    const bool forward_drop = std::find(methods_.begin(), methods_.end(), Method::kForwardDrop) != methods_.end();
    const bool filtering =
        std::any_of(methods_.begin(), methods_.end(), [](Method m) { return m != Method::kRegular; });
    if (filtering) {
      // forward_drop's middle-layer count is always aligned (it has no selection policy).
      int64_t align = forward_drop ? r.align : 1;
      for (auto policy : policies_)
        if (policy == collider::SelectPolicy::kPerSequence) align = r.align;
      for (int64_t T : axes_.seq_len) {
        for (double f : axes_.filter_ratio) {
          if (collider::kept_count(T, f, align) < 1) {
            throw ManifestError(
                fmt::format("{}: key 'axes.filter_ratio' = {} keeps no token of seq_len {} with align "
                            "{}; lower the ratio, the alignment (run.align) or raise seq_len",
                            L_.source("axes.filter_ratio"), fmt_ratio(f), T, align));
          }
        }
      }
    }
  }

  // run.data and run.reference_losses: both or neither, with score excess_loss, files present.
  void check_data() const {
    const auto& r = m_.run;
    const bool excess = spec_.score == Score::kExcessLoss;
    if (r.data.empty() && r.reference_losses.empty() && !excess) return;
    if (r.data.empty() || r.reference_losses.empty() || !excess) {
      std::vector<std::string> missing;
      if (!excess) missing.push_back("run.score = \"excess_loss\"");
      if (r.data.empty()) missing.push_back("run.data");
      if (r.reference_losses.empty()) missing.push_back("run.reference_losses");
      throw ManifestError(fmt::format(
          "{}: run.score = \"excess_loss\", run.data and run.reference_losses go together (real text scored "
          "against its reference losses); missing {}: give all three (--set run.data=\"DIR\" --set "
          "run.reference_losses=\"FILE\"), or none for random tokens",
          L_.path(), fmt::join(missing, ", ")));
    }
    const std::string shard = r.data + "/mix_train.bin";
    for (const auto& [key, file] :
         {std::pair{"run.data", shard}, std::pair{"run.reference_losses", r.reference_losses}}) {
      if (!std::filesystem::is_regular_file(file)) {
        throw ManifestError(
            fmt::format("{}: key '{}': {} not found (scripts/prepare_data.sh writes the data; the "
                        "utility experiment's reference stage the *.reflosses.f32)",
                        L_.source(key), key, file));
      }
    }
  }

  void expand() {
    std::vector<int64_t> hits(excludes_.size(), 0);
    for (const auto& model : axes_.model)
      for (int64_t T : axes_.seq_len)
        for (int64_t B : axes_.batch_size) {
          const size_t group_begin = m_.points.size();  // this (model, T, batch) group's first point
          for (double f : axes_.filter_ratio)
            for (size_t mi = 0; mi < methods_.size(); ++mi) {
              MethodSpec spec = spec_;
              spec.method = methods_[mi];
              // attention_grad multiplies only the methods that use it; the others carry "none".
              // selection multiplies only the methods that select.
              const size_t num_grads = uses_attention_grad(spec.method) ? grads_.size() : 1;
              const size_t num_policies = models::uses_selection(spec.method) ? policies_.size() : 1;
              for (size_t k = 0; k < num_policies * num_grads; ++k) {
                const size_t si = k / num_grads, gi = k % num_grads;  // each selection's attention_grads
                spec.policy = policies_[si];
                if (uses_attention_grad(spec.method)) spec.attention_grad = grads_[gi];
                Point p{model, T, B, f, axes_.method[mi], models::attention_grad_name(spec), spec};
                ++m_.num_expanded;
                bool excluded = false;
                for (size_t i = 0; i < excludes_.size(); ++i) {
                  if (matches(excludes_[i], p)) {
                    ++hits[i];
                    excluded = true;
                  }
                }
                if (excluded) {
                  ++m_.num_excluded;
                } else {
                  check_forward_drop_layers(p);
                  m_.points.push_back(p);
                }
              }
            }
          if (m_.run.floor) add_floor_points(group_begin);
          // The A/A check: the group's first regular point once more, last in the group, so the
          // two regular measurements are as far apart in each interleaved round as possible.
          if (m_.run.aa_check) {
            for (size_t k = group_begin; k < m_.points.size(); ++k) {
              if (m_.points[k].spec.method != Method::kRegular) continue;
              Point copy = m_.points[k];
              copy.aa_copy = true;
              m_.points.push_back(copy);
              ++m_.num_aa_copies;
              break;
            }
          }
        }
    for (size_t i = 0; i < excludes_.size(); ++i) {
      if (hits[i] == 0) m_.notes.push_back(fmt::format("{} matches no point (a typo?)", excludes_[i].where));
    }
    // A run with nothing to do is a mistake in the manifest, not a success (found by
    // fuzz/fuzz_manifest.cpp; tests/fuzz_regressions/manifest/).
    if (m_.points.empty()) {
      throw ManifestError(
          fmt::format("{}: [[exclude]] removes all {} points of the axes; nothing would run (narrow "
                      "an exclusion or widen the axes)",
                      path_, m_.num_expanded));
    }
  }

  // run.floor: after the points of the group that begins at `group_begin`, regular at each T'
  // its collider and forward_drop points filter to (one point per distinct T' < T).
  void add_floor_points(size_t group_begin) {
    const size_t group_end = m_.points.size();
    std::vector<int64_t> added;
    for (size_t k = group_begin; k < group_end; ++k) {
      const Point& p = m_.points[k];
      if (p.spec.method != Method::kCollider && p.spec.method != Method::kForwardDrop) continue;
      // batch_topk keeps kept_count(T, ratio, 1) per row on average: its floor is that many.
      const bool aligned =
          p.spec.policy == collider::SelectPolicy::kPerSequence || p.spec.method == Method::kForwardDrop;
      const int64_t t_prime = collider::kept_count(p.seq_len, p.filter_ratio, aligned ? m_.run.align : 1);
      if (t_prime >= p.seq_len || std::find(added.begin(), added.end(), t_prime) != added.end()) continue;
      MethodSpec spec = spec_;
      spec.method = Method::kRegular;
      Point floor{p.model, t_prime, p.batch_size, 0.0, "regular", models::attention_grad_name(spec), spec};
      floor.floor_of = p.seq_len;
      m_.points.push_back(floor);
      added.push_back(t_prime);
      ++m_.num_floor_points;
    }
  }

  // forward_drop runs the first and the last layer on every token, so a point needs 3 or more.
  void check_forward_drop_layers(const Point& p) const {
    if (p.spec.method != Method::kForwardDrop) return;
    const int64_t L = models::preset(p.model).num_layers;
    if (L >= 3) return;
    throw ManifestError(
        fmt::format("{}: key 'axes.method' = \"forward_drop\" needs models with at least 3 decoder layers (the first "
                    "and the last see every token); model '{}' has {}: drop forward_drop or the model, or exclude "
                    "their points ([[exclude]] model = [\"{}\"], method = [\"forward_drop\"])",
                    L_.source("axes.method"), p.model, L, p.model));
  }

  static bool matches(const Exclude& e, const Point& p) {
    for (const auto& [key, vals] : e.values) {
      std::string v;
      if (key == "model")
        v = p.model;
      else if (key == "seq_len")
        v = std::to_string(p.seq_len);
      else if (key == "batch_size")
        v = std::to_string(p.batch_size);
      else if (key == "filter_ratio")
        v = fmt_ratio(p.filter_ratio);
      else if (key == "method")
        v = p.method;
      else if (key == "selection")
        v = models::uses_selection(p.spec.method) ? collider::to_string(p.spec.policy) : "none";
      else
        v = p.attention_grad;
      if (std::find(vals.begin(), vals.end(), v) == vals.end()) return false;
    }
    return true;
  }
  std::string resolved() const {
    toml::table root = L_.resolved_table();
    if (!m_.run.fail_point.empty()) root["run"].as_table()->insert("fail_point", m_.run.fail_point);
    if (!excludes_.empty()) {
      toml::array ex;
      for (const auto& e : excludes_) {
        toml::table t;
        for (const auto& [k, vals] : e.values) {
          toml::array a;
          for (const auto& v : vals) {
            if (k == "seq_len" || k == "batch_size") a.push_back(std::stoll(v));
            // strtod, not stod: v is fmt_ratio's shortest round-trip form, which for a subnormal
            // ratio (4.1e-321) makes stod throw std::out_of_range; strtod returns the same value.
            else if (k == "filter_ratio")
              a.push_back(std::strtod(v.c_str(), nullptr));
            else
              a.push_back(v);
          }
          t.insert(k, a);
        }
        ex.push_back(t);
      }
      root.insert("exclude", ex);
    }
    std::ostringstream os;
    os << "# Resolved manifest: built-in defaults, then " << path_ << ", then --set overrides.\n";
    for (const auto& o : m_.overrides) os << "# " << o << "\n";
    os << fmt::format("# {} points ({} expanded, {} excluded, {} A/A copies, {} floor points).\n", m_.points.size(),
                      m_.num_expanded, m_.num_excluded, m_.num_aa_copies, m_.num_floor_points);
    os << root << "\n";
    return os.str();
  }

  std::string path_;
  bool check_device_;
  Loader L_;
  Manifest m_;
  Axes axes_;
  std::vector<Exclude> excludes_;
  MethodSpec spec_;                               // run.score, parsed (and the first selection)
  std::vector<collider::SelectPolicy> policies_;  // axes.selection, parsed
  std::vector<Method> methods_;                   // axes.method, parsed
  std::vector<collider::AttentionGrad> grads_;    // axes.attention_grad, parsed
};

std::string stem_of(const std::string& path) {
  auto slash = path.find_last_of('/');
  std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
  auto dot = base.find_last_of('.');
  return dot == std::string::npos ? base : base.substr(0, dot);
}

}  // namespace

bool Point::ragged() const {
  return spec.policy == collider::SelectPolicy::kBatchTopK && models::uses_selection(spec.method);
}

std::string Point::id() const {
  return fmt::format("{}/T{}/B{}/f{}/{}/{}{}{}", model, seq_len, batch_size, fmt_ratio(filter_ratio), method,
                     attention_grad, ragged() ? "/batch_topk" : "",
                     aa_copy        ? "/aa"
                     : floor_of > 0 ? "/floor"
                                    : "");
}

std::string Point::group_id() const {
  return fmt::format("{}/T{}/B{}", model, floor_of > 0 ? floor_of : seq_len, batch_size);
}

std::string default_manifest_toml() {
  TimingSchema schema("<defaults>", /*check_device=*/false);
  return schema.finish("defaults").resolved_toml;
}

Manifest load_manifest_text(const std::string& text, const std::string& source_name,
                            const std::vector<std::string>& sets, bool check_device) {
  const toml::table root = parse_manifest_toml(text, source_name);
  TimingSchema schema(source_name, check_device);
  schema.apply(root, sets);
  return schema.finish(stem_of(source_name));
}

Manifest load_manifest(const std::string& path, const std::vector<std::string>& sets, bool check_device) {
  return load_manifest_text(read_manifest_file(path), path, sets, check_device);
}

}  // namespace collider::harness
