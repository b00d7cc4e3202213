// Hugging Face-layout checkpoints: config.json parsing/writing, single-file and sharded
// safetensors, name-by-name parameter loading with dtype conversion, training checkpoints and
// AdamW state as named tensors. See checkpoint.h; tests in tests/test_checkpoint.cpp and
// tests/test_hf_agreement.cpp.
#include "models/checkpoint.h"

#include "base/fault.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <unordered_map>

namespace collider::models {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// File-system queries through POSIX: libtorch.so (2.11 wheel) exports its own copies of several
// std::filesystem functions that shadow libstdc++'s, and some crash (remove_all calls a null
// pointer), so we only use std::filesystem::path's member functions here.
bool is_dir(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool exists(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0;
}

void make_dirs(const std::string& dir) {
  std::string partial;
  for (const auto& part : fs::path(dir).lexically_normal()) {
    partial = partial.empty() ? part.string() : (fs::path(partial) / part).string();
    if (part.empty() || is_dir(partial)) continue;
    if (::mkdir(partial.c_str(), 0777) != 0 && errno != EEXIST)
      throw std::runtime_error(fmt::format("cannot create directory '{}': {}", partial, std::strerror(errno)));
  }
  if (!is_dir(dir)) throw std::runtime_error(fmt::format("cannot create directory '{}'", dir));
}

[[noreturn]] void config_fail(const std::string& source, const std::string& what) {
  throw std::invalid_argument(fmt::format("config '{}': {}", source, what));
}

json read_json_file(const std::string& path, const char* what) {
  std::ifstream f(path);
  if (!f) throw std::runtime_error(fmt::format("cannot open {} '{}'", what, path));
  try {
    return json::parse(f);
  } catch (const json::exception& e) {
    throw std::runtime_error(fmt::format("{} '{}' is not valid JSON ({})", what, path, e.what()));
  }
}

// A present, non-null key.
const json* get(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return nullptr;
  return &*it;
}

int64_t get_positive_int(const json& j, const char* key, const std::string& source) {
  const json* v = get(j, key);
  if (!v) config_fail(source, fmt::format("key '{}' is missing", key));
  if (!v->is_number_integer() || v->get<int64_t>() <= 0)
    config_fail(source, fmt::format("key '{}' must be a positive integer, got {}", key, v->dump()));
  return v->get<int64_t>();
}

double get_number(const json& j, const char* key, double fallback, const std::string& source) {
  const json* v = get(j, key);
  if (!v) return fallback;
  if (!v->is_number()) config_fail(source, fmt::format("key '{}' must be a number, got {}", key, v->dump()));
  return v->get<double>();
}

bool get_bool(const json& j, const char* key, bool fallback, const std::string& source) {
  const json* v = get(j, key);
  if (!v) return fallback;
  if (!v->is_boolean()) config_fail(source, fmt::format("key '{}' must be true or false, got {}", key, v->dump()));
  return v->get<bool>();
}

void require_false(const json& j, const char* key, const std::string& source, const char* why) {
  if (get_bool(j, key, false, source))
    config_fail(source, fmt::format("key '{}' = true is not supported ({})", key, why));
}

std::string to_hf_dtype(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat32: return "float32";
    case torch::kBFloat16: return "bfloat16";
    case torch::kFloat16: return "float16";
    case torch::kFloat64: return "float64";
    default: return c10::toString(t);
  }
}

std::string shape_str(torch::IntArrayRef shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

std::string join_names(const std::vector<std::string>& names, size_t max_names = 20) {
  std::vector<std::string> shown(names.begin(), names.begin() + std::min(names.size(), max_names));
  std::string s = fmt::format("{}", fmt::join(shown, ", "));
  if (names.size() > max_names) s += fmt::format(", ... ({} more)", names.size() - max_names);
  return s;
}

}  // namespace

// ---- config ----------------------------------------------------------------------------------

ModelConfig config_from_hf_json(const json& j, const std::string& source) {
  if (!j.is_object()) config_fail(source, "expected a JSON object");
  std::string arch;
  if (const json* a = get(j, "architectures"); a && a->is_array() && !a->empty() && (*a)[0].is_string())
    arch = (*a)[0].get<std::string>();
  std::string model_type;
  if (const json* m = get(j, "model_type"); m && m->is_string()) model_type = m->get<std::string>();

  ModelConfig c;
  if (arch == "LlamaForCausalLM" || (arch.empty() && model_type == "llama")) {
    c.family = Family::kLlama;
  } else if (arch == "Qwen2ForCausalLM" || (arch.empty() && model_type == "qwen2")) {
    c.family = Family::kQwen2;
  } else if (arch == "PhiForCausalLM" || (arch.empty() && model_type == "phi")) {
    c.family = Family::kPhi;
  } else {
    config_fail(source, fmt::format("architectures = '{}', model_type = '{}' is not supported (allowed: "
                                    "LlamaForCausalLM, Qwen2ForCausalLM, PhiForCausalLM)",
                                    arch, model_type));
  }
  if (const json* p = get(j, "collider_preset"); p && p->is_string())
    c.name = p->get<std::string>();
  else
    c.name = fmt::format("hf-{}", to_string(c.family));

  c.vocab_size = get_positive_int(j, "vocab_size", source);
  c.hidden_size = get_positive_int(j, "hidden_size", source);
  c.intermediate_size = get_positive_int(j, "intermediate_size", source);
  c.num_layers = get_positive_int(j, "num_hidden_layers", source);
  c.num_heads = get_positive_int(j, "num_attention_heads", source);
  c.num_kv_heads = get(j, "num_key_value_heads") ? get_positive_int(j, "num_key_value_heads", source) : c.num_heads;
  if (c.hidden_size % c.num_heads != 0)
    config_fail(source, fmt::format("hidden_size {} is not a multiple of num_attention_heads {}", c.hidden_size,
                                    c.num_heads));
  if (c.num_heads % c.num_kv_heads != 0)
    config_fail(source, fmt::format("num_attention_heads {} is not a multiple of num_key_value_heads {}",
                                    c.num_heads, c.num_kv_heads));
  c.head_dim = c.hidden_size / c.num_heads;
  if (get(j, "head_dim") && get_positive_int(j, "head_dim", source) != c.head_dim)
    config_fail(source, fmt::format("head_dim {} differs from hidden_size / num_attention_heads = {} (not supported)",
                                    (*get(j, "head_dim")).dump(), c.head_dim));
  c.max_position = get(j, "max_position_embeddings") ? get_positive_int(j, "max_position_embeddings", source) : 2048;

  // RoPE: transformers < 5 writes rope_theta / partial_rotary_factor / rope_scaling at the top
  // level; transformers 5 writes rope_parameters {rope_type, rope_theta, partial_rotary_factor}.
  const json* rp = get(j, "rope_parameters");
  if (rp && !rp->is_object()) config_fail(source, "key 'rope_parameters' must be an object");
  const json empty = json::object();
  const json& rope = rp ? *rp : empty;
  for (const json* scaling : {get(j, "rope_scaling"), rp}) {
    if (!scaling) continue;
    if (!scaling->is_object()) config_fail(source, "key 'rope_scaling' must be an object or null");
    for (const char* key : {"rope_type", "type"}) {
      const json* t = get(*scaling, key);
      if (t && !(t->is_string() && t->get<std::string>() == "default"))
        config_fail(source, fmt::format("rope {} = {} is not supported (only the default RoPE)", key, t->dump()));
    }
  }
  c.rope_theta = get_number(rope, "rope_theta", get_number(j, "rope_theta", 10000.0, source), source);
  const double default_partial = c.family == Family::kPhi ? 0.5 : 1.0;
  c.partial_rotary_factor = get_number(rope, "partial_rotary_factor",
                                       get_number(j, "partial_rotary_factor", default_partial, source), source);
  if (c.partial_rotary_factor <= 0.0 || c.partial_rotary_factor > 1.0)
    config_fail(source, fmt::format("partial_rotary_factor {} must be in (0, 1]", c.partial_rotary_factor));
  if (c.family != Family::kPhi && c.partial_rotary_factor != 1.0)
    config_fail(source, fmt::format("partial_rotary_factor {} is only supported for Phi", c.partial_rotary_factor));

  std::string act;
  if (const json* a = get(j, "hidden_act"); a && a->is_string()) act = a->get<std::string>();
  c.tie_embeddings = get_bool(j, "tie_word_embeddings", false, source);
  switch (c.family) {
    case Family::kLlama:
    case Family::kQwen2:
      if (!act.empty() && act != "silu")
        config_fail(source, fmt::format("hidden_act = '{}' is not supported for {} (allowed: silu)", act,
                                        to_string(c.family)));
      c.norm_eps = get_number(j, "rms_norm_eps", 1e-6, source);
      if (c.family == Family::kLlama) {
        require_false(j, "attention_bias", source, "our Llama has no attention biases");
        require_false(j, "mlp_bias", source, "our Llama has no MLP biases");
        c.qkv_bias = false;
      } else {
        require_false(j, "use_sliding_window", source, "sliding-window attention is not implemented");
        c.qkv_bias = true;
      }
      c.linear_bias = false;
      c.lm_head_bias = false;
      break;
    case Family::kPhi:
      if (!act.empty() && act != "gelu_new" && act != "gelu_pytorch_tanh")
        config_fail(source, fmt::format("hidden_act = '{}' is not supported for phi (allowed: gelu_new, "
                                        "gelu_pytorch_tanh: both the tanh approximation)",
                                        act));
      require_false(j, "qk_layernorm", source, "Phi's optional q/k LayerNorm is not implemented");
      c.norm_eps = get_number(j, "layer_norm_eps", 1e-5, source);
      c.qkv_bias = false;  // implied by linear_bias (as in the phi presets)
      c.linear_bias = true;
      c.lm_head_bias = true;
      if (c.tie_embeddings)
        config_fail(source, "tie_word_embeddings = true is not supported for phi (its LM head has a bias)");
      break;
  }
  return c;
}

ModelConfig read_hf_config(const std::string& path) {
  std::string file = is_dir(path) ? (fs::path(path) / "config.json").string() : path;
  if (!exists(file))
    throw std::runtime_error(fmt::format("checkpoint config '{}' does not exist (a Hugging Face checkpoint "
                                         "directory holds config.json and model.safetensors)",
                                         file));
  ModelConfig c = config_from_hf_json(read_json_file(file, "checkpoint config"), file);
  if (c.name.rfind("hf-", 0) == 0) {
    fs::path dir = is_dir(path) ? fs::path(path) : fs::path(path).parent_path();
    std::string base = (dir / "x").lexically_normal().parent_path().filename().string();
    if (!base.empty()) c.name = "hf:" + base;
  }
  return c;
}

json config_to_hf_json(const ModelConfig& c, torch::ScalarType dtype) {
  json j;
  j["collider_preset"] = c.name;
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_layers;
  j["num_attention_heads"] = c.num_heads;
  j["num_key_value_heads"] = c.num_kv_heads;
  j["head_dim"] = c.head_dim;
  j["max_position_embeddings"] = c.max_position;
  j["rope_theta"] = c.rope_theta;
  j["tie_word_embeddings"] = c.tie_embeddings;
  j["torch_dtype"] = to_hf_dtype(dtype);
  j["initializer_range"] = 0.02;
  j["attention_dropout"] = 0.0;
  switch (c.family) {
    case Family::kLlama:
      if (c.qkv_bias || c.linear_bias || c.lm_head_bias || c.partial_rotary_factor != 1.0)
        throw std::invalid_argument(fmt::format("model '{}': a Llama config with biases or partial rotary has no "
                                                "Hugging Face LlamaForCausalLM equivalent",
                                                c.name));
      j["architectures"] = {"LlamaForCausalLM"};
      j["model_type"] = "llama";
      j["hidden_act"] = "silu";
      j["rms_norm_eps"] = c.norm_eps;
      j["attention_bias"] = false;
      j["mlp_bias"] = false;
      break;
    case Family::kQwen2:
      if (!c.qkv_bias || c.linear_bias || c.lm_head_bias || c.partial_rotary_factor != 1.0)
        throw std::invalid_argument(fmt::format("model '{}': a Qwen2 config must have q/k/v biases only and full "
                                                "rotary to match Qwen2ForCausalLM",
                                                c.name));
      j["architectures"] = {"Qwen2ForCausalLM"};
      j["model_type"] = "qwen2";
      j["hidden_act"] = "silu";
      j["rms_norm_eps"] = c.norm_eps;
      j["use_sliding_window"] = false;
      break;
    case Family::kPhi:
      if (!c.linear_bias || !c.lm_head_bias || c.tie_embeddings)
        throw std::invalid_argument(fmt::format("model '{}': a Phi config must have biases on every linear layer "
                                                "and an untied LM head to match PhiForCausalLM",
                                                c.name));
      j["architectures"] = {"PhiForCausalLM"};
      j["model_type"] = "phi";
      j["hidden_act"] = "gelu_new";
      j["layer_norm_eps"] = c.norm_eps;
      j["partial_rotary_factor"] = c.partial_rotary_factor;
      j["qk_layernorm"] = false;
      j["resid_pdrop"] = 0.0;
      j["embd_pdrop"] = 0.0;
      break;
  }
  return j;
}

// ---- checkpoint files ------------------------------------------------------------------------

HfCheckpoint::HfCheckpoint(const std::string& dir) : dir_(dir) {
  if (!is_dir(dir))
    throw SafetensorsError(fmt::format("checkpoint directory '{}' does not exist or is not a directory", dir));
  const fs::path index_path = fs::path(dir) / "model.safetensors.index.json";
  const fs::path single_path = fs::path(dir) / "model.safetensors";
  if (exists(index_path.string())) {
    json index = read_json_file(index_path.string(), "checkpoint index");
    const json* wm = index.is_object() ? get(index, "weight_map") : nullptr;
    if (!wm || !wm->is_object() || wm->empty())
      throw SafetensorsError(fmt::format("checkpoint index '{}' has no weight_map object", index_path.string()));
    std::map<std::string, size_t> file_ids;
    std::map<std::string, std::string> expected;  // tensor -> shard file name
    for (auto it = wm->begin(); it != wm->end(); ++it) {
      if (!it.value().is_string())
        throw SafetensorsError(fmt::format("checkpoint index '{}': weight_map['{}'] is not a file name",
                                           index_path.string(), it.key()));
      std::string shard = it.value().get<std::string>();
      if (shard.empty() || shard.find('/') != std::string::npos || shard.find('\\') != std::string::npos ||
          shard == "." || shard == "..")
        throw SafetensorsError(fmt::format("checkpoint index '{}': shard name '{}' must be a file in the same "
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
          throw SafetensorsError(fmt::format("shard '{}' holds tensor '{}' that checkpoint index '{}' does not "
                                             "place there",
                                             f.source(), e.name, index_path.string()));
  } else if (exists(single_path.string())) {
    files_.push_back(SafetensorsFile::open(single_path.string()));
    for (const auto& e : files_[0].entries()) where_[e.name] = 0;
  } else {
    throw SafetensorsError(fmt::format("checkpoint directory '{}' has neither model.safetensors nor "
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
  if (it == where_.end())
    throw SafetensorsError(fmt::format("checkpoint '{}' has no tensor named '{}'", dir_, name));
  return files_[it->second].entry(name);
}

torch::Tensor HfCheckpoint::tensor(const std::string& name) const {
  auto it = where_.find(name);
  if (it == where_.end())
    throw SafetensorsError(fmt::format("checkpoint '{}' has no tensor named '{}'", dir_, name));
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
      problems.push_back(fmt::format("'{}' differs from '{}', but the model ties them (tie_word_embeddings)", n,
                                     tied->second));
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
        problems.push_back(fmt::format("'{}' has dtype {} in the checkpoint; a floating-point dtype is needed",
                                       p.name, c10::toString(t.scalar_type())));
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
    throw std::invalid_argument(fmt::format("checkpoint '{}' ({}: {} layers, hidden {}, vocab {}) does not have the "
                                            "shapes of model '{}' ({}: {} layers, hidden {}, vocab {})",
                                            source, to_string(b.family), b.num_layers, b.hidden_size, b.vocab_size,
                                            a.name, to_string(a.family), a.num_layers, a.hidden_size, a.vocab_size));
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
  make_dirs(dir);
  const torch::nn::Module& m = *model;
  json cfg = config_to_hf_json(model->config(), parameter_dtype(m));
  write_file_atomic((fs::path(dir) / "config.json").string(), cfg.dump(2) + "\n");
  // transformers refuses safetensors files whose metadata lacks format=pt.
  save_safetensors((fs::path(dir) / "model.safetensors").string(), parameter_tensors(m), {{"format", "pt"}});
}

void save_training_checkpoint(const std::string& dir, const CausalLM& model,
                              const std::map<std::string, torch::Tensor>& optimizer_state,
                              const json& trainer_state) {
  // Each file goes through a temporary name and a rename (write_file_atomic); a test can kill the
  // process half-way through any of them (COLLIDER_FAULT_AT=checkpoint_write, base/fault.h).
  harness::fault::Scope fault_scope("checkpoint_write");
  save_hf_model(model, dir);
  save_safetensors((fs::path(dir) / "optimizer.safetensors").string(), optimizer_state, {{"format", "pt"}});
  write_file_atomic((fs::path(dir) / "trainer_state.json").string(), trainer_state.dump(2) + "\n");
}

TrainingState load_training_checkpoint(const std::string& dir, CausalLM& model) {
  const fs::path state_path = fs::path(dir) / "trainer_state.json";
  if (!exists(state_path.string()))
    throw std::runtime_error(fmt::format("training checkpoint '{}' has no trainer_state.json (it is written last: "
                                         "the checkpoint is incomplete or not a training checkpoint)",
                                         dir));
  TrainingState s;
  s.trainer_state = read_json_file(state_path.string(), "trainer state");
  load_hf_weights(model, dir);
  s.optimizer_state = load_safetensors((fs::path(dir) / "optimizer.safetensors").string());
  return s;
}

// ---- AdamW state -----------------------------------------------------------------------------

std::map<std::string, torch::Tensor> adamw_state_tensors(torch::optim::AdamW& optimizer,
                                                         const torch::nn::Module& module) {
  std::unordered_map<const void*, std::string> names;
  for (const auto& p : unique_parameters(module)) names[p.param.unsafeGetTensorImpl()] = p.name;
  std::map<std::string, torch::Tensor> out;
  auto& groups = optimizer.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(groups[g].options());
    auto scalar = [](double v) { return torch::tensor(v, torch::kFloat64); };
    const std::string pre = fmt::format("param_groups.{}.", g);
    out[pre + "lr"] = scalar(o.lr());
    out[pre + "beta1"] = scalar(std::get<0>(o.betas()));
    out[pre + "beta2"] = scalar(std::get<1>(o.betas()));
    out[pre + "eps"] = scalar(o.eps());
    out[pre + "weight_decay"] = scalar(o.weight_decay());
    out[pre + "amsgrad"] = torch::tensor(o.amsgrad(), torch::kBool);
    for (const auto& p : groups[g].params()) {
      auto n = names.find(p.unsafeGetTensorImpl());
      if (n == names.end())
        throw std::invalid_argument("adamw_state_tensors: the optimizer holds a parameter that is not in the module");
      auto it = optimizer.state().find(p.unsafeGetTensorImpl());
      if (it == optimizer.state().end()) continue;  // no step taken yet for this parameter
      const auto& st = static_cast<const torch::optim::AdamWParamState&>(*it->second);
      const std::string sp = "state." + n->second + ".";
      out[sp + "step"] = torch::tensor(st.step(), torch::kInt64);
      out[sp + "exp_avg"] = st.exp_avg();
      out[sp + "exp_avg_sq"] = st.exp_avg_sq();
      if (st.max_exp_avg_sq().defined()) out[sp + "max_exp_avg_sq"] = st.max_exp_avg_sq();
    }
  }
  return out;
}

void restore_adamw_state(torch::optim::AdamW& optimizer, const torch::nn::Module& module,
                         const std::map<std::string, torch::Tensor>& state) {
  std::unordered_map<const void*, std::string> names;
  for (const auto& p : unique_parameters(module)) names[p.param.unsafeGetTensorImpl()] = p.name;
  auto need = [&](const std::string& key) -> const torch::Tensor& {
    auto it = state.find(key);
    if (it == state.end())
      throw SafetensorsError(fmt::format("optimizer state lacks '{}' (saved from a different optimizer or model?)",
                                         key));
    return it->second;
  };
  std::set<std::string> used;
  auto& groups = optimizer.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    auto& o = static_cast<torch::optim::AdamWOptions&>(groups[g].options());
    const std::string pre = fmt::format("param_groups.{}.", g);
    for (const char* k : {"lr", "beta1", "beta2", "eps", "weight_decay", "amsgrad"}) used.insert(pre + k);
    o.lr(need(pre + "lr").item<double>());
    o.betas({need(pre + "beta1").item<double>(), need(pre + "beta2").item<double>()});
    o.eps(need(pre + "eps").item<double>());
    o.weight_decay(need(pre + "weight_decay").item<double>());
    o.amsgrad(need(pre + "amsgrad").item<bool>());
    for (const auto& p : groups[g].params()) {
      auto n = names.find(p.unsafeGetTensorImpl());
      if (n == names.end())
        throw std::invalid_argument("restore_adamw_state: the optimizer holds a parameter that is not in the module");
      const std::string sp = "state." + n->second + ".";
      if (!state.count(sp + "step")) {
        optimizer.state().erase(p.unsafeGetTensorImpl());
        continue;
      }
      auto st = std::make_unique<torch::optim::AdamWParamState>();
      auto like_param = [&](const std::string& key) {
        const torch::Tensor& t = need(key);
        if (t.sizes() != p.sizes())
          throw SafetensorsError(fmt::format("optimizer state '{}' has shape {} but the parameter has {}", key,
                                             shape_str(t.sizes()), shape_str(p.sizes())));
        used.insert(key);
        return t.to(p.options(), /*non_blocking=*/false, /*copy=*/true);
      };
      used.insert(sp + "step");
      st->step(need(sp + "step").item<int64_t>());
      st->exp_avg(like_param(sp + "exp_avg"));
      st->exp_avg_sq(like_param(sp + "exp_avg_sq"));
      if (state.count(sp + "max_exp_avg_sq")) st->max_exp_avg_sq(like_param(sp + "max_exp_avg_sq"));
      optimizer.state()[p.unsafeGetTensorImpl()] = std::move(st);
    }
  }
  std::vector<std::string> extra;
  for (const auto& kv : state)
    if (!used.count(kv.first)) extra.push_back(kv.first);
  if (!extra.empty())
    throw SafetensorsError(fmt::format("optimizer state has unexpected tensors ({}): {} (saved from a different "
                                       "optimizer or model?)",
                                       extra.size(), join_names(extra)));
}

}  // namespace collider::models
