// Hugging Face config.json parsing and writing (see hf_config.h). Tests in tests/test_checkpoint.cpp
// and tests/test_hf_agreement.cpp.
#include "models/hf_config.h"

#include "base/fsutil.h"

#include <fmt/format.h>

#include <filesystem>
#include <fstream>

namespace collider::models {

namespace fs = std::filesystem;
using nlohmann::json;

namespace detail {

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
const json* json_field(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return nullptr;
  return &*it;
}

}  // namespace detail

namespace {

using detail::json_field;
using detail::read_json_file;

[[noreturn]] void config_fail(const std::string& source, const std::string& what) {
  throw std::invalid_argument(fmt::format("config '{}': {}", source, what));
}
int64_t get_positive_int(const json& j, const char* key, const std::string& source) {
  const json* v = json_field(j, key);
  if (!v) config_fail(source, fmt::format("key '{}' is missing", key));
  if (!v->is_number_integer() || v->get<int64_t>() <= 0)
    config_fail(source, fmt::format("key '{}' must be a positive integer, got {}", key, v->dump()));
  return v->get<int64_t>();
}

double get_number(const json& j, const char* key, double fallback, const std::string& source) {
  const json* v = json_field(j, key);
  if (!v) return fallback;
  if (!v->is_number()) config_fail(source, fmt::format("key '{}' must be a number, got {}", key, v->dump()));
  return v->get<double>();
}

bool get_bool(const json& j, const char* key, bool fallback, const std::string& source) {
  const json* v = json_field(j, key);
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
    case torch::kFloat32:
      return "float32";
    case torch::kBFloat16:
      return "bfloat16";
    case torch::kFloat16:
      return "float16";
    case torch::kFloat64:
      return "float64";
    default:
      return c10::toString(t);
  }
}

}  // namespace

// ---- config ----------------------------------------------------------------------------------

ModelConfig config_from_hf_json(const json& j, const std::string& source) {
  if (!j.is_object()) config_fail(source, "expected a JSON object");
  std::string arch;
  if (const json* a = json_field(j, "architectures"); a && a->is_array() && !a->empty() && (*a)[0].is_string())
    arch = (*a)[0].get<std::string>();
  std::string model_type;
  if (const json* m = json_field(j, "model_type"); m && m->is_string()) model_type = m->get<std::string>();

  ModelConfig c;
  if (arch == "LlamaForCausalLM" || (arch.empty() && model_type == "llama")) {
    c.family = Family::kLlama;
  } else if (arch == "Qwen2ForCausalLM" || (arch.empty() && model_type == "qwen2")) {
    c.family = Family::kQwen2;
  } else if (arch == "PhiForCausalLM" || (arch.empty() && model_type == "phi")) {
    c.family = Family::kPhi;
  } else if (arch == "MixtralForCausalLM" || (arch.empty() && model_type == "mixtral")) {
    c.family = Family::kMixtral;
  } else {
    config_fail(source, fmt::format("architectures = '{}', model_type = '{}' is not supported (allowed: "
                                    "LlamaForCausalLM, Qwen2ForCausalLM, PhiForCausalLM, MixtralForCausalLM)",
                                    arch, model_type));
  }
  if (const json* p = json_field(j, "collider_preset"); p && p->is_string())
    c.name = p->get<std::string>();
  else
    c.name = fmt::format("hf-{}", to_string(c.family));

  c.vocab_size = get_positive_int(j, "vocab_size", source);
  c.hidden_size = get_positive_int(j, "hidden_size", source);
  c.intermediate_size = get_positive_int(j, "intermediate_size", source);
  c.num_layers = get_positive_int(j, "num_hidden_layers", source);
  c.num_heads = get_positive_int(j, "num_attention_heads", source);
  c.num_kv_heads =
      json_field(j, "num_key_value_heads") ? get_positive_int(j, "num_key_value_heads", source) : c.num_heads;
  if (c.hidden_size % c.num_heads != 0)
    config_fail(source,
                fmt::format("hidden_size {} is not a multiple of num_attention_heads {}", c.hidden_size, c.num_heads));
  if (c.num_heads % c.num_kv_heads != 0)
    config_fail(source, fmt::format("num_attention_heads {} is not a multiple of num_key_value_heads {}", c.num_heads,
                                    c.num_kv_heads));
  c.head_dim = c.hidden_size / c.num_heads;
  if (json_field(j, "head_dim") && get_positive_int(j, "head_dim", source) != c.head_dim)
    config_fail(source, fmt::format("head_dim {} differs from hidden_size / num_attention_heads = {} (not supported)",
                                    (*json_field(j, "head_dim")).dump(), c.head_dim));
  c.max_position =
      json_field(j, "max_position_embeddings") ? get_positive_int(j, "max_position_embeddings", source) : 2048;

  // RoPE: transformers < 5 writes rope_theta / partial_rotary_factor / rope_scaling at the top
  // level; transformers 5 writes rope_parameters {rope_type, rope_theta, partial_rotary_factor}.
  const json* rp = json_field(j, "rope_parameters");
  if (rp && !rp->is_object()) config_fail(source, "key 'rope_parameters' must be an object");
  const json empty = json::object();
  const json& rope = rp ? *rp : empty;
  for (const json* scaling : {json_field(j, "rope_scaling"), rp}) {
    if (!scaling) continue;
    if (!scaling->is_object()) config_fail(source, "key 'rope_scaling' must be an object or null");
    for (const char* key : {"rope_type", "type"}) {
      const json* t = json_field(*scaling, key);
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
  if (const json* a = json_field(j, "hidden_act"); a && a->is_string()) act = a->get<std::string>();
  c.tie_embeddings = get_bool(j, "tie_word_embeddings", false, source);
  switch (c.family) {
    case Family::kMixtral:
      c.num_experts = get_positive_int(j, "num_local_experts", source);
      c.experts_per_token = get_positive_int(j, "num_experts_per_tok", source);
      [[fallthrough]];
    case Family::kLlama:
    case Family::kQwen2:
      if (!act.empty() && act != "silu")
        config_fail(source,
                    fmt::format("hidden_act = '{}' is not supported for {} (allowed: silu)", act, to_string(c.family)));
      c.norm_eps = get_number(j, "rms_norm_eps", 1e-6, source);
      if (c.family == Family::kMixtral) {
        c.qkv_bias = false;
      } else if (c.family == Family::kLlama) {
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
  std::string file = fsutil::is_directory(path) ? (fs::path(path) / "config.json").string() : path;
  if (!fsutil::exists(file))
    throw std::runtime_error(
        fmt::format("checkpoint config '{}' does not exist (a Hugging Face checkpoint "
                    "directory holds config.json and model.safetensors)",
                    file));
  ModelConfig c = config_from_hf_json(read_json_file(file, "checkpoint config"), file);
  if (c.name.rfind("hf-", 0) == 0) {
    fs::path dir = fsutil::is_directory(path) ? fs::path(path) : fs::path(path).parent_path();
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
    case Family::kMixtral: {  // Mixtral: Llama's attention and norms, a mixture of experts for the MLP
      const bool moe = c.family == Family::kMixtral;
      if (c.qkv_bias || c.linear_bias || c.lm_head_bias || c.partial_rotary_factor != 1.0)
        throw std::invalid_argument(
            fmt::format("model '{}': a {} config with biases or partial rotary has no "
                        "Hugging Face {} equivalent",
                        c.name, moe ? "Mixtral" : "Llama", moe ? "MixtralForCausalLM" : "LlamaForCausalLM"));
      j["architectures"] = {moe ? "MixtralForCausalLM" : "LlamaForCausalLM"};
      j["model_type"] = moe ? "mixtral" : "llama";
      j["hidden_act"] = "silu";
      j["rms_norm_eps"] = c.norm_eps;
      if (moe) {
        j["num_local_experts"] = c.num_experts;
        j["num_experts_per_tok"] = c.experts_per_token;
        j["router_jitter_noise"] = 0.0;
        j["experts_implementation"] = "eager";
      } else {
        j["attention_bias"] = false;
        j["mlp_bias"] = false;
      }
      break;
    }
    case Family::kQwen2:
      if (!c.qkv_bias || c.linear_bias || c.lm_head_bias || c.partial_rotary_factor != 1.0)
        throw std::invalid_argument(
            fmt::format("model '{}': a Qwen2 config must have q/k/v biases only and full "
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
        throw std::invalid_argument(
            fmt::format("model '{}': a Phi config must have biases on every linear layer "
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

}  // namespace collider::models
