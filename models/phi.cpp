// Phi family (Phi-1.5): the parallel block — one LayerNorm feeds attention and MLP, both added
// to the residual — with partial rotary (the first half of each 64-dim head rotated), a GELU
// (tanh) MLP, a bias on every linear layer, the attention output named "dense", the final norm
// "final_layernorm", and an untied LM head with bias. HF: PhiForCausalLM.
// Tested by tests/test_models.cpp.
#include "models/common/architecture.h"

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
      }};
  return arch;
}

}  // namespace collider::models::detail
