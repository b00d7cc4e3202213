// Hugging Face config.json parsing and writing (see hf_config.h): the keys every family has, and
// each family's own through its Architecture's mapping (models/common/architecture.h). Tests in tests/test_checkpoint.cpp
// and tests/test_hf_agreement.cpp.
#include "models/hf_config.h"

#include "base/fsutil.h"
#include "models/common/architecture.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

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

using detail::HfKeys;

void detail::HfKeys::fail(const std::string& what) const {
  throw std::invalid_argument(fmt::format("config '{}': {}", source_, what));
}

const json* detail::HfKeys::field(const char* key) const { return detail::json_field(j_, key); }

int64_t detail::HfKeys::positive_int(const char* key) const {
  const json* v = field(key);
  if (!v) fail(fmt::format("key '{}' is missing", key));
  if (!v->is_number_integer() || v->get<int64_t>() <= 0)
    fail(fmt::format("key '{}' must be a positive integer, got {}", key, v->dump()));
  return v->get<int64_t>();
}

double detail::HfKeys::number(const char* key, double fallback) const {
  const json* v = field(key);
  if (!v) return fallback;
  if (!v->is_number()) fail(fmt::format("key '{}' must be a number, got {}", key, v->dump()));
  return v->get<double>();
}

bool detail::HfKeys::boolean(const char* key, bool fallback) const {
  const json* v = field(key);
  if (!v) return fallback;
  if (!v->is_boolean()) fail(fmt::format("key '{}' must be true or false, got {}", key, v->dump()));
  return v->get<bool>();
}

std::string detail::HfKeys::string(const char* key) const {
  const json* v = field(key);
  return v && v->is_string() ? v->get<std::string>() : std::string();
}

void detail::HfKeys::require_false(const char* key, const char* why) const {
  if (boolean(key, false)) fail(fmt::format("key '{}' = true is not supported ({})", key, why));
}

double detail::HfKeys::rope_number(const char* key, double fallback) const {
  const double top = number(key, fallback);
  const json* rp = field("rope_parameters");
  return rp ? HfKeys(*rp, source_).number(key, top) : top;
}

namespace {

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
  if (!j.is_object()) HfKeys(j, source).fail("expected a JSON object");
  const HfKeys keys(j, source);
  std::string arch;
  if (const json* a = keys.field("architectures"); a && a->is_array() && !a->empty() && (*a)[0].is_string())
    arch = (*a)[0].get<std::string>();
  const std::string model_type = keys.string("model_type");

  const detail::Architecture* family = nullptr;
  std::vector<std::string> classes;
  for (const auto* a : detail::architectures()) {
    if (arch == a->hf.class_name || (arch.empty() && model_type == a->hf.model_type)) family = a;
    classes.push_back(a->hf.class_name);
  }
  if (!family) {
    keys.fail(fmt::format("architectures = '{}', model_type = '{}' is not supported (allowed: {})", arch, model_type,
                          fmt::join(classes, ", ")));
  }
  ModelConfig c;
  c.family = family->family;
  c.name = keys.field("collider_preset") && keys.field("collider_preset")->is_string()
               ? keys.string("collider_preset")
               : fmt::format("hf-{}", to_string(c.family));

  c.vocab_size = keys.positive_int("vocab_size");
  c.hidden_size = keys.positive_int("hidden_size");
  c.intermediate_size = keys.positive_int("intermediate_size");
  c.num_layers = keys.positive_int("num_hidden_layers");
  c.num_heads = keys.positive_int("num_attention_heads");
  c.num_kv_heads = keys.field("num_key_value_heads") ? keys.positive_int("num_key_value_heads") : c.num_heads;
  if (c.hidden_size % c.num_heads != 0)
    keys.fail(fmt::format("hidden_size {} is not a multiple of num_attention_heads {}", c.hidden_size, c.num_heads));
  if (c.num_heads % c.num_kv_heads != 0)
    keys.fail(fmt::format("num_attention_heads {} is not a multiple of num_key_value_heads {}", c.num_heads,
                          c.num_kv_heads));
  c.head_dim = c.hidden_size / c.num_heads;
  if (keys.field("head_dim") && keys.positive_int("head_dim") != c.head_dim)
    keys.fail(fmt::format("head_dim {} differs from hidden_size / num_attention_heads = {} (not supported)",
                          keys.field("head_dim")->dump(), c.head_dim));
  c.max_position = keys.field("max_position_embeddings") ? keys.positive_int("max_position_embeddings") : 2048;

  // RoPE: transformers < 5 writes rope_theta / partial_rotary_factor / rope_scaling at the top
  // level; transformers 5 writes rope_parameters {rope_type, rope_theta, partial_rotary_factor}.
  const json* rp = keys.field("rope_parameters");
  if (rp && !rp->is_object()) keys.fail("key 'rope_parameters' must be an object");
  for (const json* scaling : {keys.field("rope_scaling"), rp}) {
    if (!scaling) continue;
    if (!scaling->is_object()) keys.fail("key 'rope_scaling' must be an object or null");
    for (const char* key : {"rope_type", "type"}) {
      const json* t = detail::json_field(*scaling, key);
      if (t && !(t->is_string() && t->get<std::string>() == "default"))
        keys.fail(fmt::format("rope {} = {} is not supported (only the default RoPE)", key, t->dump()));
    }
  }
  c.rope_theta = keys.rope_number("rope_theta", 10000.0);
  // Full rotary unless the file says otherwise (Phi's reader has its own default).
  c.partial_rotary_factor = keys.rope_number("partial_rotary_factor", 1.0);
  if (c.partial_rotary_factor <= 0.0 || c.partial_rotary_factor > 1.0)
    keys.fail(fmt::format("partial_rotary_factor {} must be in (0, 1]", c.partial_rotary_factor));
  c.tie_embeddings = keys.boolean("tie_word_embeddings", false);
  family->hf.read(keys, c);
  return c;
}

ModelConfig read_hf_config(const std::string& path) {
  std::string file = fsutil::is_directory(path) ? (fs::path(path) / "config.json").string() : path;
  if (!fsutil::exists(file))
    throw std::runtime_error(
        fmt::format("checkpoint config '{}' does not exist (a Hugging Face checkpoint "
                    "directory holds config.json and model.safetensors)",
                    file));
  ModelConfig c = config_from_hf_json(detail::read_json_file(file, "checkpoint config"), file);
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
  const detail::HfMapping& hf = detail::architecture(c.family).hf;
  j["architectures"] = {hf.class_name};
  j["model_type"] = hf.model_type;
  hf.write(c, j);
  return j;
}

}  // namespace collider::models
