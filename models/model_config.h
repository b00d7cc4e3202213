// A model's configuration, its attention implementation, and the preset table: what the FLOP formulas,
// the manifests and the Hugging Face config reader need of a model without building one (the
// module itself is models/model.h).
// Legend: B batch, T sequence, D hidden, H heads, G kv-heads, E head-dim, F ffn, V vocab,
// X experts, K experts per token.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace collider::models {

enum class Family { kLlama, kQwen2, kPhi, kMixtral };
const char* to_string(Family f);

// How a model computes its attention cores (run.attention_impl in the manifests).
enum class AttentionImpl {
  kEager,  // explicit matmul - scale - causal mask - softmax - matmul (the paper's setting)
  kSdpa,   // torch scaled_dot_product_attention
};
const char* to_string(AttentionImpl a);
// Throws std::invalid_argument naming the value and listing attention_impl_names().
AttentionImpl attention_impl_from_string(const std::string& s);
const std::vector<std::string>& attention_impl_names();  // in declaration order: "eager", "sdpa"

struct ModelConfig {
  std::string name;  // preset name, e.g. "tinyllama-1.1b", "qwen2.5-mini"
  Family family = Family::kLlama;
  int64_t vocab_size = 0;         // V
  int64_t hidden_size = 0;        // D
  int64_t intermediate_size = 0;  // F
  int64_t num_layers = 0;
  int64_t num_heads = 0;     // H
  int64_t num_kv_heads = 0;  // G (GQA: H % G == 0)
  int64_t head_dim = 0;      // E = D / H
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;
  double partial_rotary_factor = 1.0;  // Phi: 0.5 (32 of 64 head dims rotated)
  int64_t max_position = 4096;
  bool qkv_bias = false;        // Qwen2: bias on q/k/v projections
  bool linear_bias = false;     // Phi: bias on every linear layer
  bool tie_embeddings = false;  // Qwen2: LM head shares the embedding matrix
  bool lm_head_bias = false;    // Phi
  // Mixture of experts (Mixtral): X experts, each a SwiGLU MLP of width F, K of them per token
  // (top-K of a linear router's softmax). 0 for the dense families.
  int64_t num_experts = 0;        // X
  int64_t experts_per_token = 0;  // K

  int64_t num_params() const;  // analytic, counted from the fields (tied head counted once)
};

// Every preset: the three paper models and their CPU-scale `-mini` versions, the mixture of
// experts mixtral-mini (CPU scale), tinyllama-micro for the utility table, and `-debug` sizes.
const std::vector<ModelConfig>& presets();
// Throws std::invalid_argument listing the known names when `name` is unknown.
const ModelConfig& preset(const std::string& name);

}  // namespace collider::models
