// A preset's FlopShape (flops.h): its GEMM shapes, with the MLP's matrices from its architecture.
// Kept apart from flops.cpp, which the Python bindings compile without the model zoo.
// Tested by tests/test_flops.cpp.
#include "models/common/architecture.h"
#include "models/flops.h"

namespace collider::models {

FlopShape::FlopShape(const ModelConfig& cfg)
    : name(cfg.name),
      vocab_size(cfg.vocab_size),
      hidden_size(cfg.hidden_size),
      intermediate_size(cfg.intermediate_size),
      num_layers(cfg.num_layers),
      num_heads(cfg.num_heads),
      num_kv_heads(cfg.num_kv_heads),
      head_dim(cfg.head_dim),
      mlp_matrices(detail::architecture(cfg.family).mlp == detail::MlpKind::kGeluTanh ? 2 : 3),
      num_experts(cfg.num_experts),
      experts_per_token(cfg.experts_per_token) {}

}  // namespace collider::models
