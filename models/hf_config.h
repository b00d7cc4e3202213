// Hugging Face config.json <-> ModelConfig: reads LlamaForCausalLM, Qwen2ForCausalLM and
// PhiForCausalLM configs, rejects what our models cannot reproduce (naming the key, the value and
// what is allowed), and writes the config.json transformers' from_pretrained loads. The tensors
// of a checkpoint are models/hf_tensors.h; training checkpoints models/checkpoint.h.
// Tests: tests/test_checkpoint.cpp (config parsing and round trips), tests/test_hf_agreement.cpp.
#pragma once

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <string>

#include "models/model_config.h"

namespace collider::models {

// ---- config.json <-> ModelConfig ---------------------------------------------------------------
// Reads LlamaForCausalLM, Qwen2ForCausalLM and PhiForCausalLM configs (both the older top-level
// rope_theta / partial_rotary_factor keys and transformers 5's rope_parameters). Anything our
// models cannot reproduce (rope scaling, sliding window, o_proj/MLP bias on Llama, Phi's
// qk_layernorm, another activation) is an error naming the key, the value and what is allowed.
// `source` names the file in errors.
ModelConfig config_from_hf_json(const nlohmann::json& j, const std::string& source);
// `path` is a checkpoint directory (its config.json is read) or a config.json file.
ModelConfig read_hf_config(const std::string& path);
// The Hugging Face config.json of `cfg` (loadable by transformers' from_pretrained); `dtype` is
// written as torch_dtype.
nlohmann::json config_to_hf_json(const ModelConfig& cfg, torch::ScalarType dtype = torch::kFloat32);

namespace detail {
// Reads and parses the JSON file `path`; errors name `what` ("checkpoint config") and the path.
nlohmann::json read_json_file(const std::string& path, const char* what);
// j[key] when present and not null, else nullptr.
const nlohmann::json* json_field(const nlohmann::json& j, const char* key);
}  // namespace detail

}  // namespace collider::models
