// Llama family (TinyLlama-1.1B): sequential pre-norm blocks with RMSNorm, grouped-query
// attention with full RoPE, SwiGLU MLP, no biases, untied LM head. HF: LlamaForCausalLM.
// The blocks are shared (common/); this file holds only what makes it Llama, and its presets.
// Tested by tests/test_models.cpp; `build/collider models` lists the presets.
#include "models/common/architecture.h"

#include <fmt/format.h>

namespace collider::models::detail {

namespace {
ModelConfig llama(std::string name, int64_t layers, int64_t hidden, int64_t ffn, int64_t heads, int64_t kv_heads,
                  int64_t vocab) {
  ModelConfig c;
  c.name = std::move(name);
  c.family = Family::kLlama;
  c.num_layers = layers;
  c.hidden_size = hidden;
  c.intermediate_size = ffn;
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.head_dim = hidden / heads;
  c.vocab_size = vocab;
  c.norm_eps = 1e-5;
  c.rope_theta = 10000.0;
  c.max_position = 2048;
  return c;
}
}  // namespace

void read_llama_like_hf(const HfKeys& j, ModelConfig& c) {
  if (const std::string act = j.string("hidden_act"); !act.empty() && act != "silu")
    j.fail(fmt::format("hidden_act = '{}' is not supported for {} (allowed: silu)", act, to_string(c.family)));
  if (c.partial_rotary_factor != 1.0)
    j.fail(fmt::format("partial_rotary_factor {} is only supported for Phi", c.partial_rotary_factor));
  c.norm_eps = j.number("rms_norm_eps", 1e-6);
  c.qkv_bias = false;
  c.linear_bias = false;
  c.lm_head_bias = false;
}

void write_llama_like_hf(const ModelConfig& c, nlohmann::json& j, const char* hf_class, bool qkv_bias) {
  if (c.qkv_bias != qkv_bias || c.linear_bias || c.lm_head_bias || c.partial_rotary_factor != 1.0)
    throw std::invalid_argument(fmt::format(
        "model '{}': Hugging Face {} has {}, and full rotary; this config's biases or rotary differ, so it has no "
        "{} equivalent",
        c.name, hf_class, qkv_bias ? "biases on q/k/v only" : "no biases", hf_class));
  j["hidden_act"] = "silu";
  j["rms_norm_eps"] = c.norm_eps;
}

namespace {
void read_llama_hf(const HfKeys& j, ModelConfig& c) {
  read_llama_like_hf(j, c);
  j.require_false("attention_bias", "our Llama has no attention biases");
  j.require_false("mlp_bias", "our Llama has no MLP biases");
}

void write_llama_hf(const ModelConfig& c, nlohmann::json& j) {
  write_llama_like_hf(c, j, "LlamaForCausalLM", /*qkv_bias=*/false);
  j["attention_bias"] = false;
  j["mlp_bias"] = false;
}
}  // namespace

const Architecture& llama_architecture() {
  static const Architecture arch{
      Family::kLlama,
      NormKind::kRMSNorm,
      MlpKind::kSwiGLU,
      BlockKind::kSequential,
      "o_proj",
      "norm",
      {
          // TinyLlama/TinyLlama-1.1B: 1,100,048,384 parameters.
          llama("tinyllama-1.1b", 22, 2048, 5632, 32, 4, 32000),
          // CPU scale: head dim 64 and GQA ratio 8 kept (8 heads, 1 KV head); D = 512 puts the
          // attention/linear FLOP ratio at T = 512 and 1024 within 2x of the paper's at T = 2048
          // (see flops.h); FFN 3 D (paper 2.75 D) centres the ratio in that window.
          llama("tinyllama-mini", 4, 512, 1536, 8, 1, 8192),
          // The utility table (experiments/tab_utility.toml): a third of tinyllama-mini's FLOPs per
          // token, so that 2 CPU cores train 3 seeds x 8 methods on 4x the tokens in about 2 hours.
          // GQA ratio 8 kept (head dim 32).
          llama("tinyllama-micro", 4, 256, 768, 8, 1, 8192),
          // Unit tests: GQA ratio 8, head dim 8.
          llama("tinyllama-debug", 2, 64, 176, 8, 1, 256),
      },
      {"LlamaForCausalLM", "llama", read_llama_hf, write_llama_hf}};
  return arch;
}

}  // namespace collider::models::detail
