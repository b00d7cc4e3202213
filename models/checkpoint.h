// Our training checkpoints (resume): a Hugging Face checkpoint directory (models/hf_tensors.h)
// plus optimizer.safetensors and trainer_state.json, and AdamW state as named tensors. Every file
// is written through the shared atomic writer (base/fsutil.h).
// Tests: tests/test_checkpoint.cpp (bit-exact resume), tests/test_fault_injection_slow.cpp (a
// process killed while writing one).
#pragma once

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <map>
#include <string>

#include "models/hf_tensors.h"
#include "models/model.h"

namespace collider::models {

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
