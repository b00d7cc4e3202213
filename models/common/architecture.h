// What distinguishes one architecture from another, as data: which norm, which MLP, which
// decoder-block shape, the HF names that differ, and the family's presets. Each architecture
// file (llama.cpp, qwen2.cpp, phi.cpp, mixtral.cpp) defines one Architecture; the generic builder
// (build_decoder_layer) and the analytic parameter / FLOP counts (model.cpp, flops.cpp) read it.
// The table is explicit (architectures()) rather than filled by static registrars, which a
// static library's linker would silently drop.
// Legend: D hidden, F ffn, V vocab.
//
// Adding a family:
//  1. models/<family>.cpp: its Architecture (norm, MLP, block, HF names) and presets, with a -debug
//     and a -mini preset whose attention/linear FLOP ratio stays within 2x of the paper-scale
//     model's (DESIGN.md section 7; tests/test_flops.cpp checks it);
//  2. a Family value and its name (model_config.h, model.cpp), the declaration below and its entry in
//     architectures() (architecture.cpp);
//  3. a new NormKind / MlpKind / BlockKind only if no block in common/blocks.h fits, with its
//     parameter count (model.cpp) and its GEMMs in linear_flops_per_token (flops.cpp);
//  4. its config.json mapping (the Architecture's hf: class name, model type, the reader and writer
//     of its own keys) so that HF checkpoints load by name;
//  5. the family in the lists of tests/test_models.cpp and tests/test_collider_models.cpp (the
//     gradient oracles of DESIGN.md), and in the family list of docs/ARCHITECTURE.md, "What is where".
#pragma once

#include "models/common/blocks.h"
#include "models/common/hf_keys.h"

#include <nlohmann/json.hpp>

#include <memory>
#include <vector>

namespace collider::models::detail {

enum class NormKind { kRMSNorm, kLayerNorm };
enum class MlpKind { kSwiGLU, kGeluTanh, kMoE };  // SwiGLU: 3 matrices D x F; GELU: 2; MoE: X SwiGLU experts
enum class BlockKind { kSequential, kParallel };

// The family's config.json beyond the keys every family has (sizes, heads, RoPE theta, tied
// embeddings: models/hf_config.cpp reads and writes those first).
struct HfMapping {
  const char* class_name;  // architectures[0]: "LlamaForCausalLM"
  const char* model_type;  // "llama"
  // Reads the family's keys into c (norm, biases, activation, partial rotary, experts), refusing
  // what the family's blocks cannot reproduce.
  void (*read)(const HfKeys& j, ModelConfig& c);
  // Writes them; throws std::invalid_argument when c has no equivalent in that class.
  void (*write)(const ModelConfig& c, nlohmann::json& j);
};

struct Architecture {
  Family family;
  NormKind norm;
  MlpKind mlp;
  BlockKind block;
  const char* attn_out_name;    // "o_proj" (Llama, Qwen2) or "dense" (Phi)
  const char* final_norm_name;  // "norm" (Llama, Qwen2) or "final_layernorm" (Phi)
  std::vector<ModelConfig> presets;
  HfMapping hf;
};

const Architecture& llama_architecture();  // llama.cpp
const Architecture& qwen2_architecture();  // qwen2.cpp
const Architecture& phi_architecture();    // phi.cpp
const Architecture& mixtral_architecture();  // mixtral.cpp
const std::vector<const Architecture*>& architectures();
const Architecture& architecture(Family f);

// The config.json keys Llama's blocks share with Qwen2 and Mixtral (SiLU, RMSNorm's eps, full
// rotary, no biases but Qwen2's q/k/v ones), read and written by llama.cpp for all three.
void read_llama_like_hf(const HfKeys& j, ModelConfig& c);
// The writer first checks that c has the biases of `hf_class` (q/k/v biases when qkv_bias, no
// other) and full rotary, and throws std::invalid_argument naming both otherwise.
void write_llama_like_hf(const ModelConfig& c, nlohmann::json& j, const char* hf_class, bool qkv_bias);

// Rotary dims per head: int(E * partial_rotary_factor), as HF.
int64_t rotary_dim(const ModelConfig& cfg);
// Throws std::invalid_argument naming the field when a config cannot be built.
void validate_config(const ModelConfig& cfg);

// One decoder layer of cfg's family, from the shared blocks.
std::shared_ptr<DecoderLayerImpl> build_decoder_layer(const ModelConfig& cfg);
std::shared_ptr<NormImpl> build_norm(const ModelConfig& cfg);

}  // namespace collider::models::detail
