// The tensors of a Hugging Face checkpoint directory and our models' parameters: model.safetensors,
// or shards listed in model.safetensors.index.json (weight_map), read on demand; name-by-name
// loading into a module (our parameter names are Hugging Face's, models/model.h) with bf16/fp16/fp32
// converted to the parameter's dtype; whole models loaded from and saved to a directory
// (config.json through models/hf_config.h). Training checkpoints are models/checkpoint.h.
// Tests: tests/test_checkpoint.cpp (round trips, shards, mismatches) and tests/test_hf_agreement.cpp
// (logits of transformers' own tiny models, fixtures from scripts/make_hf_fixtures.py).
#pragma once

#include <torch/torch.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "models/hf_config.h"
#include "models/model.h"
#include "models/safetensors.h"

namespace collider::models {

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
                     const std::function<torch::Tensor(const std::string&)>& read_tensor, const std::string& source,
                     const LoadOptions& options = {});
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

}  // namespace collider::models
