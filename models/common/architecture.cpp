// The generic decoder-layer builder and config validation (see architecture.h): turns an
// Architecture description plus a ModelConfig into shared blocks with HF names.
// Tested by tests/test_models.cpp.
#include "models/common/architecture.h"

#include "models/common/attention.h"

#include <fmt/format.h>

#include <stdexcept>

namespace collider::models::detail {

const std::vector<const Architecture*>& architectures() {
  static const std::vector<const Architecture*> all{&llama_architecture(), &qwen2_architecture(), &phi_architecture(),
                                                    &mixtral_architecture()};
  return all;
}

const Architecture& architecture(Family f) {
  for (const auto* a : architectures())
    if (a->family == f) return *a;
  throw std::invalid_argument(fmt::format("no architecture registered for family {}", static_cast<int>(f)));
}

int64_t rotary_dim(const ModelConfig& cfg) {
  return static_cast<int64_t>(static_cast<double>(cfg.head_dim) * cfg.partial_rotary_factor);
}

void validate_config(const ModelConfig& c) {
  auto fail = [&](const std::string& what) {
    throw std::invalid_argument(fmt::format("model config '{}': {}", c.name, what));
  };
  if (c.vocab_size <= 0) fail(fmt::format("vocab_size must be positive, got {}", c.vocab_size));
  if (c.hidden_size <= 0) fail(fmt::format("hidden_size must be positive, got {}", c.hidden_size));
  if (c.intermediate_size <= 0) fail(fmt::format("intermediate_size must be positive, got {}", c.intermediate_size));
  if (c.num_layers <= 0) fail(fmt::format("num_layers must be positive, got {}", c.num_layers));
  if (c.num_heads <= 0 || c.num_kv_heads <= 0 || c.num_heads % c.num_kv_heads != 0)
    fail(fmt::format("num_heads ({}) must be a positive multiple of num_kv_heads ({})", c.num_heads, c.num_kv_heads));
  if (c.head_dim <= 0) fail(fmt::format("head_dim must be positive, got {}", c.head_dim));
  const int64_t r = rotary_dim(c);
  if (r <= 0 || r % 2 != 0 || r > c.head_dim)
    fail(fmt::format("rotary dims int(head_dim {} * partial_rotary_factor {}) = {} must be even and in (0, head_dim]",
                     c.head_dim, c.partial_rotary_factor, r));
  if (c.norm_eps <= 0) fail(fmt::format("norm_eps must be positive, got {}", c.norm_eps));
  if (c.rope_theta <= 0) fail(fmt::format("rope_theta must be positive, got {}", c.rope_theta));
  if (c.tie_embeddings && c.lm_head_bias) fail("a tied LM head cannot have a bias (lm_head_bias with tie_embeddings)");
  if (architecture(c.family).mlp == MlpKind::kMoE) {
    if (c.num_experts < 2 || c.experts_per_token < 1 || c.experts_per_token > c.num_experts)
      fail(fmt::format("a mixture of experts needs num_experts >= 2 and 1 <= experts_per_token <= num_experts, got {} "
                       "and {}",
                       c.num_experts, c.experts_per_token));
  } else if (c.num_experts != 0 || c.experts_per_token != 0) {
    fail(fmt::format("num_experts / experts_per_token are for mixture-of-experts families, not {}", to_string(c.family)));
  }
}

std::shared_ptr<NormImpl> build_norm(const ModelConfig& cfg) {
  if (architecture(cfg.family).norm == NormKind::kRMSNorm)
    return std::make_shared<RMSNormImpl>(cfg.hidden_size, cfg.norm_eps);
  return std::make_shared<LayerNormImpl>(cfg.hidden_size, cfg.norm_eps);
}

std::shared_ptr<DecoderLayerImpl> build_decoder_layer(const ModelConfig& cfg) {
  const Architecture& arch = architecture(cfg.family);
  AttentionOptions ao;
  ao.hidden = cfg.hidden_size;
  ao.num_heads = cfg.num_heads;
  ao.num_kv_heads = cfg.num_kv_heads;
  ao.head_dim = cfg.head_dim;
  ao.qkv_bias = cfg.qkv_bias || cfg.linear_bias;
  ao.out_bias = cfg.linear_bias;
  ao.out_name = arch.attn_out_name;
  auto attn = std::make_shared<SelfAttentionImpl>(ao);
  std::shared_ptr<MlpImpl> mlp;
  if (arch.mlp == MlpKind::kSwiGLU)
    mlp = std::make_shared<SwiGluMlpImpl>(cfg.hidden_size, cfg.intermediate_size, cfg.linear_bias);
  else if (arch.mlp == MlpKind::kMoE)
    mlp = std::make_shared<MoeMlpImpl>(cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.experts_per_token);
  else
    mlp = std::make_shared<GeluMlpImpl>(cfg.hidden_size, cfg.intermediate_size, cfg.linear_bias);
  if (arch.block == BlockKind::kSequential)
    return std::make_shared<SequentialBlockImpl>(build_norm(cfg), attn, build_norm(cfg), mlp);
  return std::make_shared<ParallelBlockImpl>(build_norm(cfg), attn, mlp);
}

}  // namespace collider::models::detail
