// Checkpoints in Hugging Face layout: config.json + model.safetensors, or shards listed in
// model.safetensors.index.json (weight_map). Tensors map to our parameters by name (our names are
// Hugging Face's, models/model.h); bf16/fp16/fp32 are converted to the model's dtype. Also our own
// training checkpoints: the same two files plus optimizer.safetensors and trainer_state.json.
// Tests: tests/test_checkpoint.cpp (round trips, resume) and tests/test_hf_agreement.cpp (logits
// of transformers' own tiny models, fixtures from scripts/make_hf_fixtures.py).
#pragma once

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "models/model.h"
#include "models/safetensors.h"

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

// ---- the tensors of a checkpoint directory -------------------------------------------------------
// Opens model.safetensors, or every shard named in model.safetensors.index.json, and checks that the
// index and the shards agree. Tensors are read on demand (tensor()), so a caller can convert one
// at a time.
class HfCheckpoint {
 public:
  explicit HfCheckpoint(const std::string& dir);
  const std::string& dir() const { return dir_; }
  std::vector<std::string> names() const;  // sorted
  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  torch::Tensor tensor(const std::string& name) const;  // CPU, the file's dtype
  const SafetensorsEntry& entry(const std::string& name) const;
  size_t num_files() const { return files_.size(); }

 private:
  std::string dir_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, size_t> where_;  // tensor name -> index into files_
};

// ---- name-by-name loading ---------------------------------------------------------------------
struct LoadOptions {
  // Names the checkpoint may hold although the module has no such parameter, because they
  // duplicate another tensor of the checkpoint (a tied LM head: {"lm_head.weight",
  // "model.embed_tokens.weight"}); accepted only when bit-equal to that tensor.
  std::map<std::string, std::string> tied;
  // Checkpoint names ending in one of these are derived buffers we recompute, and are skipped
  // (older Llama checkpoints carry rotary_emb.inv_freq).
  std::vector<std::string> ignored_suffixes = {"rotary_emb.inv_freq"};
};

// Copies every parameter of `module` from the tensor of the same name, converting dtype to the
// parameter's (copy_ rounds to nearest-even) and device. Before copying anything it checks the
// whole set and throws SafetensorsError listing, by name, the missing tensors, the unexpected
// tensors, shape mismatches and non-floating tensors for floating parameters. A parameter that
// aliases an earlier one (same tensor registered twice) is loaded once.
void load_parameters(torch::nn::Module& module, const std::vector<std::string>& checkpoint_names,
                     const std::function<torch::Tensor(const std::string&)>& read_tensor,
                     const std::string& source, const LoadOptions& options = {});
// The same from an in-memory map (tests, optimizer state).
void load_parameters(torch::nn::Module& module, const std::map<std::string, torch::Tensor>& tensors,
                     const std::string& source, const LoadOptions& options = {});
// Parameters by name, aliases dropped (what save_hf_model writes).
std::map<std::string, torch::Tensor> parameter_tensors(const torch::nn::Module& module);

// ---- whole models ----------------------------------------------------------------------------
struct HfLoadOptions {
  AttentionImpl attention = AttentionImpl::kEager;
  torch::ScalarType dtype = torch::kFloat32;  // the model's parameter dtype after loading
  torch::Device device = torch::kCPU;
};
// config.json -> ModelConfig -> build_model -> parameters from the safetensors file(s).
CausalLM load_hf_model(const std::string& dir, const HfLoadOptions& options = {});
// Loads the parameters of `dir` into an existing model (whose config must match config.json's shapes).
void load_hf_weights(CausalLM& model, const std::string& dir);
// Writes config.json + model.safetensors (parameters in their current dtype; tied head omitted, as
// transformers does) into `dir`, creating it. transformers' from_pretrained loads the result.
void save_hf_model(const CausalLM& model, const std::string& dir);

// ---- training checkpoints (resume) -------------------------------------------------------------
// dir/config.json, dir/model.safetensors, dir/optimizer.safetensors (the caller's optimizer state
// tensors, by name), dir/trainer_state.json (the caller's step metadata, written last so that its
// presence marks a complete checkpoint). All bit-exact on reload.
void save_training_checkpoint(const std::string& dir, const CausalLM& model,
                              const std::map<std::string, torch::Tensor>& optimizer_state,
                              const nlohmann::json& trainer_state);
struct TrainingState {
  std::map<std::string, torch::Tensor> optimizer_state;  // CPU tensors as saved
  nlohmann::json trainer_state;
};
// Loads the weights into `model` (bit-exact when dtypes match) and returns the rest.
TrainingState load_training_checkpoint(const std::string& dir, CausalLM& model);

// AdamW state <-> named tensors, keyed by `module`'s parameter names:
//   state.<param>.step (I64 scalar), state.<param>.exp_avg, state.<param>.exp_avg_sq,
//   state.<param>.max_exp_avg_sq (amsgrad only), and per group param_groups.<i>.{lr, beta1,
//   beta2, eps, weight_decay} (F64 scalars) and param_groups.<i>.amsgrad (BOOL).
// Restoring into an optimizer over the same parameters makes the next steps bit-identical.
std::map<std::string, torch::Tensor> adamw_state_tensors(torch::optim::AdamW& optimizer,
                                                         const torch::nn::Module& module);
void restore_adamw_state(torch::optim::AdamW& optimizer, const torch::nn::Module& module,
                         const std::map<std::string, torch::Tensor>& state);

}  // namespace collider::models
