// Phi family (Phi-1.5): the parallel block — one LayerNorm feeds attention and MLP, both added
// to the residual — with partial rotary (the first half of each 64-dim head rotated), a GELU
// (tanh) MLP, a bias on every linear layer, the attention output named "dense", the final norm
// "final_layernorm", and an untied LM head with bias. HF: PhiForCausalLM.
// Tested by tests/test_models.cpp.
#include "models/common/architecture.h"

#include <fmt/format.h>

namespace collider::models::detail {

namespace {
ModelConfig phi(std::string name, int64_t layers, int64_t hidden, int64_t ffn, int64_t heads, int64_t vocab) {
  ModelConfig c;
  c.name = std::move(name);
  c.family = Family::kPhi;
  c.num_layers = layers;
  c.hidden_size = hidden;
  c.intermediate_size = ffn;
  c.num_heads = heads;
  c.num_kv_heads = heads;  // Phi-1.5 has no GQA
  c.head_dim = hidden / heads;
  c.vocab_size = vocab;
  c.norm_eps = 1e-5;
  c.rope_theta = 10000.0;
  c.partial_rotary_factor = 0.5;
  c.max_position = 2048;
  c.linear_bias = true;
  c.lm_head_bias = true;
  return c;
}
}  // namespace

namespace {
void read_phi_hf(const HfKeys& j, ModelConfig& c) {
  if (const std::string act = j.string("hidden_act"); !act.empty() && act != "gelu_new" && act != "gelu_pytorch_tanh")
    j.fail(fmt::format("hidden_act = '{}' is not supported for phi (allowed: gelu_new, gelu_pytorch_tanh: both the "
                       "tanh approximation)",
                       act));
  j.require_false("qk_layernorm", "Phi's optional q/k LayerNorm is not implemented");
  c.partial_rotary_factor = j.rope_number("partial_rotary_factor", 0.5);  // Phi-1.5's default
  c.norm_eps = j.number("layer_norm_eps", 1e-5);
  c.qkv_bias = false;  // implied by linear_bias (as in the phi presets)
  c.linear_bias = true;
  c.lm_head_bias = true;
  if (c.tie_embeddings) j.fail("tie_word_embeddings = true is not supported for phi (its LM head has a bias)");
}

void write_phi_hf(const ModelConfig& c, nlohmann::json& j) {
  if (!c.linear_bias || !c.lm_head_bias || c.tie_embeddings)
    throw std::invalid_argument(fmt::format(
        "model '{}': a Phi config must have biases on every linear layer and an untied LM head to match "
        "PhiForCausalLM",
        c.name));
  j["hidden_act"] = "gelu_new";
  j["layer_norm_eps"] = c.norm_eps;
  j["partial_rotary_factor"] = c.partial_rotary_factor;
  j["qk_layernorm"] = false;
  j["resid_pdrop"] = 0.0;
  j["embd_pdrop"] = 0.0;
}
}  // namespace

const Architecture& phi_architecture() {
  static const Architecture arch{
      Family::kPhi,
      NormKind::kLayerNorm,
      MlpKind::kGeluTanh,
      BlockKind::kParallel,
      "dense",
      "final_layernorm",
      {
          // microsoft/phi-1_5: 1,418,270,720 parameters.
          phi("phi-1.5", 24, 2048, 8192, 32, 51200),
          // CPU scale: head dim 64 with 32 rotary dims, FFN 4 D, biases, parallel block; D = 576
          // (9 heads) puts the attention/linear FLOP ratio at T = 512 and 1024 within 2x of the
          // paper's at T = 2048 (see flops.h).
          phi("phi-1.5-mini", 4, 576, 2304, 9, 8192),
          phi("phi-1.5-debug", 2, 64, 256, 4, 256),
      },
      {"PhiForCausalLM", "phi", read_phi_hf, write_phi_hf}};
  return arch;
}

}  // namespace collider::models::detail
