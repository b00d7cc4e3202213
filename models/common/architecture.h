// What distinguishes one architecture from another, as data: which norm, which MLP, which
// decoder-block shape, the HF names that differ, and the family's presets. Each architecture
// file (llama.cpp, qwen2.cpp, phi.cpp, mixtral.cpp) defines one Architecture; the generic builder
// (build_decoder_layer) and the analytic parameter / FLOP counts (model.cpp, flops.cpp) read it.
// The table is explicit (architectures()) rather than filled by static registrars, which a
// static library's linker would silently drop.
// Legend: D hidden, F ffn, V vocab.
#pragma once

#include "models/common/blocks.h"

#include <memory>
#include <vector>

namespace collider::models::detail {

enum class NormKind { kRMSNorm, kLayerNorm };
enum class MlpKind { kSwiGLU, kGeluTanh, kMoE };  // SwiGLU: 3 matrices D x F; GELU: 2; MoE: X SwiGLU experts
enum class BlockKind { kSequential, kParallel };

struct Architecture {
  Family family;
  NormKind norm;
  MlpKind mlp;
  BlockKind block;
  const char* attn_out_name;    // "o_proj" (Llama, Qwen2) or "dense" (Phi)
  const char* final_norm_name;  // "norm" (Llama, Qwen2) or "final_layernorm" (Phi)
  std::vector<ModelConfig> presets;
};

const Architecture& llama_architecture();  // llama.cpp
const Architecture& qwen2_architecture();  // qwen2.cpp
const Architecture& phi_architecture();    // phi.cpp
const Architecture& mixtral_architecture();  // mixtral.cpp
const std::vector<const Architecture*>& architectures();
const Architecture& architecture(Family f);

// Rotary dims per head: int(E * partial_rotary_factor), as HF.
int64_t rotary_dim(const ModelConfig& cfg);
// Throws std::invalid_argument naming the field when a config cannot be built.
void validate_config(const ModelConfig& cfg);

// One decoder layer of cfg's family, from the shared blocks.
std::shared_ptr<DecoderLayerImpl> build_decoder_layer(const ModelConfig& cfg);
std::shared_ptr<NormImpl> build_norm(const ModelConfig& cfg);

}  // namespace collider::models::detail
