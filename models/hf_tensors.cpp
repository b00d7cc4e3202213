// Hugging Face checkpoint tensors (see hf_tensors.h): single-file and sharded safetensors,
// name-by-name parameter loading with dtype conversion, whole-model load and save. Tests in
// tests/test_checkpoint.cpp and tests/test_hf_agreement.cpp.
#include "models/hf_tensors.h"

#include "base/fsutil.h"

#include <fmt/format.h>

#include <filesystem>
#include <set>

namespace collider::models {

namespace fs = std::filesystem;
using nlohmann::json;
using detail::join_names;
using detail::json_field;
using detail::read_json_file;
using detail::shape_str;

// ---- checkpoint files ------------------------------------------------------------------------

HfCheckpoint::HfCheckpoint(const std::string& dir) : dir_(dir) {
  if (!fsutil::is_directory(dir))
    throw SafetensorsError(fmt::format("checkpoint directory '{}' does not exist or is not a directory", dir));
  const fs::path index_path = fs::path(dir) / "model.safetensors.index.json";
  const fs::path single_path = fs::path(dir) / "model.safetensors";
  if (fsutil::exists(index_path.string())) {
    json index = read_json_file(index_path.string(), "checkpoint index");
    const json* wm = index.is_object() ? json_field(index, "weight_map") : nullptr;
    if (!wm || !wm->is_object() || wm->empty())
      throw SafetensorsError(fmt::format("checkpoint index '{}' has no weight_map object", index_path.string()));
    std::map<std::string, size_t> file_ids;
    std::map<std::string, std::string> expected;  // tensor -> shard file name
    for (auto it = wm->begin(); it != wm->end(); ++it) {
      if (!it.value().is_string())
        throw SafetensorsError(
            fmt::format("checkpoint index '{}': weight_map['{}'] is not a file name", index_path.string(), it.key()));
      std::string shard = it.value().get<std::string>();
      if (shard.empty() || shard.find('/') != std::string::npos || shard.find('\\') != std::string::npos ||
          shard == "." || shard == "..")
        throw SafetensorsError(
            fmt::format("checkpoint index '{}': shard name '{}' must be a file in the same "
                        "directory",
                        index_path.string(), shard));
      expected[it.key()] = shard;
      if (!file_ids.count(shard)) {
        file_ids[shard] = files_.size();
        files_.push_back(SafetensorsFile::open((fs::path(dir) / shard).string()));
      }
    }
    for (const auto& [name, shard] : expected) {
      const size_t id = file_ids.at(shard);
      if (!files_[id].contains(name))
        throw SafetensorsError(fmt::format("checkpoint index '{}' places tensor '{}' in '{}', which does not hold it",
                                           index_path.string(), name, shard));
      where_[name] = id;
    }
    for (const auto& f : files_)
      for (const auto& e : f.entries())
        if (!expected.count(e.name) || files_[where_.at(e.name)].source() != f.source())
          throw SafetensorsError(
              fmt::format("shard '{}' holds tensor '{}' that checkpoint index '{}' does not "
                          "place there",
                          f.source(), e.name, index_path.string()));
  } else if (fsutil::exists(single_path.string())) {
    files_.push_back(SafetensorsFile::open(single_path.string()));
    for (const auto& e : files_[0].entries()) where_[e.name] = 0;
  } else {
    throw SafetensorsError(
        fmt::format("checkpoint directory '{}' has neither model.safetensors nor "
                    "model.safetensors.index.json (pytorch_model.bin is not read: convert it "
                    "to safetensors)",
                    dir));
  }
}

std::vector<std::string> HfCheckpoint::names() const {
  std::vector<std::string> out;
  for (const auto& kv : where_) out.push_back(kv.first);
  return out;
}

const SafetensorsEntry& HfCheckpoint::entry(const std::string& name) const {
  auto it = where_.find(name);
  if (it == where_.end()) throw SafetensorsError(fmt::format("checkpoint '{}' has no tensor named '{}'", dir_, name));
  return files_[it->second].entry(name);
}

torch::Tensor HfCheckpoint::tensor(const std::string& name) const {
  auto it = where_.find(name);
  if (it == where_.end()) throw SafetensorsError(fmt::format("checkpoint '{}' has no tensor named '{}'", dir_, name));
  return files_[it->second].tensor(name);
}

// ---- loading by name -------------------------------------------------------------------------

namespace {

struct NamedParam {
  std::string name;
  torch::Tensor param;
};

// Parameters in registration order, a tensor registered twice kept under its first name only.
std::vector<NamedParam> unique_parameters(const torch::nn::Module& module) {
  std::vector<NamedParam> out;
  std::set<const void*> seen;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    const void* impl = item.value().unsafeGetTensorImpl();
    if (!seen.insert(impl).second) continue;
    out.push_back({item.key(), item.value()});
  }
  return out;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

std::map<std::string, torch::Tensor> parameter_tensors(const torch::nn::Module& module) {
  std::map<std::string, torch::Tensor> out;
  for (auto& p : unique_parameters(module)) out.emplace(p.name, p.param);
  return out;
}

void load_parameters(torch::nn::Module& module, const std::vector<std::string>& checkpoint_names,
                     const std::function<torch::Tensor(const std::string&)>& read_tensor, const std::string& source,
                     const LoadOptions& options) {
  const std::vector<NamedParam> params = unique_parameters(module);
  std::set<std::string> param_names;
  for (const auto& p : params) param_names.insert(p.name);
  const std::set<std::string> file_names(checkpoint_names.begin(), checkpoint_names.end());

  std::vector<std::string> missing, unexpected, problems;
  for (const auto& p : params)
    if (!file_names.count(p.name)) missing.push_back(p.name);
  for (const auto& n : file_names) {
    if (param_names.count(n)) continue;
    bool ignored = false;
    for (const auto& s : options.ignored_suffixes) ignored = ignored || ends_with(n, s);
    if (ignored) continue;
    auto tied = options.tied.find(n);
    if (tied != options.tied.end() && file_names.count(tied->second)) {
      torch::Tensor a = read_tensor(n), b = read_tensor(tied->second);
      if (a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() && torch::equal(a, b)) continue;
      problems.push_back(
          fmt::format("'{}' differs from '{}', but the model ties them (tie_word_embeddings)", n, tied->second));
      continue;
    }
    unexpected.push_back(n);
  }
  // Shapes and dtypes from the headers alone would need the entry type here; reading tensors is
  // deferred to the copy, so check shapes on the tensors we are about to copy, all before copying.
  std::vector<std::pair<torch::Tensor, torch::Tensor>> copies;  // (param, source tensor)
  if (missing.empty() && unexpected.empty() && problems.empty()) {
    for (const auto& p : params) {
      torch::Tensor t = read_tensor(p.name);
      if (t.sizes() != p.param.sizes()) {
        problems.push_back(fmt::format("'{}' has shape {} in the checkpoint but {} in the model", p.name,
                                       shape_str(t.sizes()), shape_str(p.param.sizes())));
      } else if (p.param.is_floating_point() && !t.is_floating_point()) {
        problems.push_back(fmt::format("'{}' has dtype {} in the checkpoint; a floating-point dtype is needed", p.name,
                                       c10::toString(t.scalar_type())));
      } else {
        copies.emplace_back(p.param, std::move(t));
      }
    }
  }
  if (!missing.empty() || !unexpected.empty() || !problems.empty()) {
    std::string msg = fmt::format("checkpoint '{}' does not match the model", source);
    if (!missing.empty()) msg += fmt::format("; missing tensors ({}): {}", missing.size(), join_names(missing));
    if (!unexpected.empty())
      msg += fmt::format("; unexpected tensors ({}): {}", unexpected.size(), join_names(unexpected));
    if (!problems.empty()) msg += fmt::format("; {}", join_names(problems));
    msg += " (is config.json the one written with these weights?)";
    throw SafetensorsError(msg);
  }
  torch::NoGradGuard no_grad;
  for (auto& [param, t] : copies) param.copy_(t);
}

void load_parameters(torch::nn::Module& module, const std::map<std::string, torch::Tensor>& tensors,
                     const std::string& source, const LoadOptions& options) {
  std::vector<std::string> names;
  for (const auto& kv : tensors) names.push_back(kv.first);
  load_parameters(
      module, names, [&](const std::string& n) { return tensors.at(n); }, source, options);
}

// ---- whole models ----------------------------------------------------------------------------

namespace {

LoadOptions options_for(const ModelConfig& cfg) {
  LoadOptions o;
  if (cfg.tie_embeddings) o.tied["lm_head.weight"] = "model.embed_tokens.weight";
  return o;
}

void check_same_shapes(const ModelConfig& a, const ModelConfig& b, const std::string& source) {
  auto same = a.family == b.family && a.vocab_size == b.vocab_size && a.hidden_size == b.hidden_size &&
              a.intermediate_size == b.intermediate_size && a.num_layers == b.num_layers &&
              a.num_heads == b.num_heads && a.num_kv_heads == b.num_kv_heads &&
              (a.qkv_bias || a.linear_bias) == (b.qkv_bias || b.linear_bias) && a.linear_bias == b.linear_bias &&
              a.tie_embeddings == b.tie_embeddings && a.lm_head_bias == b.lm_head_bias;
  if (!same)
    throw std::invalid_argument(
        fmt::format("checkpoint '{}' ({}: {} layers, hidden {}, vocab {}) does not have the "
                    "shapes of model '{}' ({}: {} layers, hidden {}, vocab {})",
                    source, to_string(b.family), b.num_layers, b.hidden_size, b.vocab_size, a.name, to_string(a.family),
                    a.num_layers, a.hidden_size, a.vocab_size));
}

void load_weights_from(CausalLM& model, const HfCheckpoint& ckpt) {
  load_parameters(
      *model, ckpt.names(), [&](const std::string& n) { return ckpt.tensor(n); }, ckpt.dir(),
      options_for(model->config()));
}

torch::ScalarType parameter_dtype(const torch::nn::Module& module) {
  for (const auto& p : module.parameters()) return p.scalar_type();
  return torch::kFloat32;
}

}  // namespace

CausalLM load_hf_model(const std::string& dir, const HfLoadOptions& options) {
  ModelConfig cfg = read_hf_config(dir);
  HfCheckpoint ckpt(dir);  // open and validate the files before building the model
  CausalLM model = build_model(cfg, options.attention, /*seed=*/0);
  model->to(options.dtype);
  load_weights_from(model, ckpt);
  model->to(options.device);
  return model;
}

void load_hf_weights(CausalLM& model, const std::string& dir) {
  ModelConfig cfg = read_hf_config(dir);
  check_same_shapes(model->config(), cfg, dir);
  load_weights_from(model, HfCheckpoint(dir));
}

void save_hf_model(const CausalLM& model, const std::string& dir) {
  fsutil::make_dirs(dir);
  if (!fsutil::is_directory(dir)) throw std::runtime_error(fmt::format("cannot create directory '{}'", dir));
  const torch::nn::Module& m = *model;
  json cfg = config_to_hf_json(model->config(), parameter_dtype(m));
  fsutil::write_file_atomic((fs::path(dir) / "config.json").string(), cfg.dump(2) + "\n");
  // transformers refuses safetensors files whose metadata lacks format=pt.
  save_safetensors((fs::path(dir) / "model.safetensors").string(), parameter_tensors(m), {{"format", "pt"}});
}

}  // namespace collider::models
