// Qwen2 family (Qwen2.5-1.5B): the Llama block diagram (sequential pre-norm, RMSNorm, GQA with
// full RoPE, SwiGLU) with the differences that make it Qwen2: bias on the q/k/v projections,
// RMSNorm eps 1e-6, RoPE theta 1e6, and an LM head tied to the token embedding (no lm_head.weight).
// HF: Qwen2ForCausalLM. Tested by tests/test_models.cpp.
#include "models/common/architecture.h"

#include <fmt/format.h>

namespace collider::models::detail {

namespace {
ModelConfig qwen2(std::string name, int64_t layers, int64_t hidden, int64_t ffn, int64_t heads, int64_t kv_heads,
                  int64_t head_dim, int64_t vocab) {
  ModelConfig c;
  c.name = std::move(name);
  c.family = Family::kQwen2;
  c.num_layers = layers;
  c.hidden_size = hidden;
  c.intermediate_size = ffn;
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.head_dim = head_dim;
  c.vocab_size = vocab;
  c.norm_eps = 1e-6;
  c.rope_theta = 1000000.0;
  c.max_position = 32768;
  c.qkv_bias = true;
  c.tie_embeddings = true;
  return c;
}
}  // namespace

namespace {
void read_qwen2_hf(const HfKeys& j, ModelConfig& c) {
  read_llama_like_hf(j, c);
  j.require_false("use_sliding_window", "sliding-window attention is not implemented");
  c.qkv_bias = true;
}

void write_qwen2_hf(const ModelConfig& c, nlohmann::json& j) {
  write_llama_like_hf(c, j, "Qwen2ForCausalLM", /*qkv_bias=*/true);
  j["use_sliding_window"] = false;
}
}  // namespace

const Architecture& qwen2_architecture() {
  static const Architecture arch{
      Family::kQwen2,
      NormKind::kRMSNorm,
      MlpKind::kSwiGLU,
      BlockKind::kSequential,
      "o_proj",
      "norm",
      {
          // Qwen/Qwen2.5-1.5B: 1,543,714,304 parameters (head dim 128, GQA ratio 6).
          qwen2("qwen2.5-1.5b", 28, 1536, 8960, 12, 2, 128, 151936),
          // CPU scale: GQA ratio 6 (6 heads, 1 KV head), QKV bias, tied head, FFN 35/6 D as the
          // paper model; D = 480 (head dim 80) puts the attention/linear FLOP ratio at T = 512
          // and 1024 within 2x of the paper's at T = 2048 (see flops.h).
          qwen2("qwen2.5-mini", 4, 480, 2800, 6, 1, 80, 8192),
          // The same with Qwen2.5's real vocabulary, 151,936: the LM head's [B, T, V] logits then
          // outweigh the decoder (the fused head's whole-step benchmark, experiments/bench_head_step.toml).
          qwen2("qwen2.5-mini-v152k", 4, 480, 2800, 6, 1, 80, 151936),
          qwen2("qwen2.5-debug", 2, 48, 128, 6, 1, 8, 256),
      },
      {"Qwen2ForCausalLM", "qwen2", read_qwen2_hf, write_qwen2_hf}};
  return arch;
}

}  // namespace collider::models::detail
