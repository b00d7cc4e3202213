// Mixtral family (Mixtral-8x7B's shape at CPU scale): Llama's sequential pre-norm blocks (RMSNorm,
// grouped-query attention with full RoPE, no biases, untied LM head) with a sparse mixture of
// experts in place of the MLP: X SwiGLU experts, K of them per token (common/blocks.h,
// MoeMlpImpl). HF: MixtralForCausalLM with experts_implementation="eager". Collider cuts a dropped
// token's rows from every expert it was routed to (collider_core/src/routes.h).
// Tested by tests/test_models.cpp and tests/test_collider_models.cpp; `build/collider models`
// lists the presets.
#include "models/common/architecture.h"

#include <fmt/format.h>

namespace collider::models::detail {

namespace {
ModelConfig mixtral(std::string name, int64_t layers, int64_t hidden, int64_t ffn, int64_t heads, int64_t kv_heads,
                    int64_t vocab, int64_t experts, int64_t per_token) {
  ModelConfig c;
  c.name = std::move(name);
  c.family = Family::kMixtral;
  c.num_layers = layers;
  c.hidden_size = hidden;
  c.intermediate_size = ffn;
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.head_dim = hidden / heads;
  c.vocab_size = vocab;
  c.num_experts = experts;
  c.experts_per_token = per_token;
  c.norm_eps = 1e-5;
  c.rope_theta = 1e6;
  c.max_position = 4096;
  return c;
}
}  // namespace

namespace {
// Llama's attention and norms, a mixture of experts for the MLP.
void read_mixtral_hf(const HfKeys& j, ModelConfig& c) {
  c.num_experts = j.positive_int("num_local_experts");
  c.experts_per_token = j.positive_int("num_experts_per_tok");
  read_llama_like_hf(j, c);
}

void write_mixtral_hf(const ModelConfig& c, nlohmann::json& j) {
  write_llama_like_hf(c, j, "MixtralForCausalLM", /*qkv_bias=*/false);
  j["num_local_experts"] = c.num_experts;
  j["num_experts_per_tok"] = c.experts_per_token;
  j["router_jitter_noise"] = 0.0;
  j["experts_implementation"] = "eager";
}
}  // namespace

const Architecture& mixtral_architecture() {
  static const Architecture arch{
      Family::kMixtral,
      NormKind::kRMSNorm,
      MlpKind::kMoE,
      BlockKind::kSequential,
      "o_proj",
      "norm",
      {
          // CPU scale: top-2 of 8 experts and GQA ratio 4 as Mixtral-8x7B; head dim 64. An expert
          // is F = 768 wide, so a token's routed MLP work (2 experts x 3 D F) equals
          // tinyllama-mini's dense MLP (3 D x 1536): the two presets differ in routing only.
          mixtral("mixtral-mini", 4, 512, 768, 8, 2, 8192, 8, 2),
          // Unit tests: 4 experts, top-2, GQA ratio 4, head dim 8.
          mixtral("mixtral-debug", 2, 64, 96, 8, 2, 256, 4, 2),
      },
      {"MixtralForCausalLM", "mixtral", read_mixtral_hf, write_mixtral_hf}};
  return arch;
}

}  // namespace collider::models::detail
