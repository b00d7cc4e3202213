// Training checkpoints and AdamW state as named tensors (see checkpoint.h). Tests in
// tests/test_checkpoint.cpp and tests/test_fault_injection_slow.cpp.
#include "models/checkpoint.h"

#include "base/fault.h"
#include "base/fsutil.h"

#include <fmt/format.h>

#include <filesystem>
#include <set>
#include <unordered_map>

namespace collider::models {

namespace fs = std::filesystem;
using nlohmann::json;
using detail::join_names;
using detail::read_json_file;
using detail::shape_str;

void save_training_checkpoint(const std::string& dir, const CausalLM& model,
                              const std::map<std::string, torch::Tensor>& optimizer_state, const json& trainer_state) {
  // Each file goes through a temporary name and a rename (fsutil::write_file_atomic); a
  // test can kill the process half-way through any of them (COLLIDER_FAULT_AT=checkpoint_write,
  // base/fault.h).
  fault::Scope fault_scope("checkpoint_write");
  save_hf_model(model, dir);
  save_safetensors((fs::path(dir) / "optimizer.safetensors").string(), optimizer_state, {{"format", "pt"}});
  fsutil::write_file_atomic((fs::path(dir) / "trainer_state.json").string(), trainer_state.dump(2) + "\n");
}

TrainingState load_training_checkpoint(const std::string& dir, CausalLM& model) {
  const fs::path state_path = fs::path(dir) / "trainer_state.json";
  if (!fsutil::exists(state_path.string()))
    throw std::runtime_error(
        fmt::format("training checkpoint '{}' has no trainer_state.json (it is written last: "
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
  for (const auto& [name, param] : parameter_tensors(module)) names[param.unsafeGetTensorImpl()] = name;
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
  for (const auto& [name, param] : parameter_tensors(module)) names[param.unsafeGetTensorImpl()] = name;
  auto need = [&](const std::string& key) -> const torch::Tensor& {
    auto it = state.find(key);
    if (it == state.end())
      throw SafetensorsError(
          fmt::format("optimizer state lacks '{}' (saved from a different optimizer or model?)", key));
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
    throw SafetensorsError(
        fmt::format("optimizer state has unexpected tensors ({}): {} (saved from a different "
                    "optimizer or model?)",
                    extra.size(), join_names(extra)));
}

}  // namespace collider::models
