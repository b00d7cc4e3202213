// Shared building blocks of the architectures (Llama, Qwen2, Phi, Mixtral): linear and
// embedding layers, RMSNorm / LayerNorm, SwiGLU / GELU(tanh) / mixture-of-experts MLPs, and the two decoder-block
// shapes (sequential pre-norm: Llama, Qwen2; parallel: Phi). Attention lives in attention.h,
// rotary embedding in rotary.h. Numerics follow Hugging Face transformers op for op, so that
// logits match its checkpoints; submodule names are the HF names (checkpoints map by name).
// Tested by tests/test_models.cpp.
// Legend: B batch, T sequence, D hidden, H heads, G kv-heads, E head-dim, F ffn, V vocab,
// R rotary dims, M = B*T token rows, X experts, K experts per token, R (MoE) rows routed to one expert.
#pragma once

#include "models/model.h"

#include <torch/torch.h>

#include <memory>
#include <string>

namespace collider::models::detail {

// Inputs every layer of one forward shares; built once per forward by CausalLMImpl.
struct ForwardContext {
  AttentionImpl attn = AttentionImpl::kEager;
  torch::Tensor cos_TR, sin_TR;                   // rotary tables [T, R] for positions 0..T-1, or [B, T, R]
                                                  // for each row's own positions (no grad), x's dtype
  torch::Tensor causal_mask_TT;                   // bool [T, T], true above the diagonal (masked), no grad
  const AttentionHook* attention_hook = nullptr;  // computes the attention core when set (model.h), or null
};

// y = x W^T (+ b), as torch.nn.Linear. weight [out, in], bias [out] or undefined.
class LinearImpl : public torch::nn::Module {
 public:
  LinearImpl(int64_t in_features, int64_t out_features, bool bias);
  torch::Tensor forward(const torch::Tensor& x) const;
  torch::Tensor weight, bias;
};
TORCH_MODULE(Linear);

// Token embedding, as torch.nn.Embedding. weight [V, D].
class EmbeddingImpl : public torch::nn::Module {
 public:
  EmbeddingImpl(int64_t num_embeddings, int64_t dim);
  torch::Tensor forward(const torch::Tensor& ids_BT) const;  // -> x_BTD
  torch::Tensor weight;
};
TORCH_MODULE(Embedding);

// Interface of the two normalisations, so that blocks hold either.
class NormImpl : public torch::nn::Module {
 public:
  virtual torch::Tensor forward(const torch::Tensor& x_BTD) const = 0;
};

// HF LlamaRMSNorm / Qwen2RMSNorm: computed in fp32 (double stays double), cast back to the
// input dtype, then weight * normalized. weight [D].
class RMSNormImpl : public NormImpl {
 public:
  RMSNormImpl(int64_t dim, double eps);
  torch::Tensor forward(const torch::Tensor& x_BTD) const override;
  torch::Tensor weight;
  double eps;
};

// torch.nn.LayerNorm (Phi). weight [D], bias [D].
class LayerNormImpl : public NormImpl {
 public:
  LayerNormImpl(int64_t dim, double eps);
  torch::Tensor forward(const torch::Tensor& x_BTD) const override;
  torch::Tensor weight, bias;
  double eps;
};

class MlpImpl : public torch::nn::Module {
 public:
  virtual torch::Tensor forward(const torch::Tensor& x_BTD) const = 0;
};

// Llama / Qwen2 MLP: down_proj(silu(gate_proj(x)) * up_proj(x)).
class SwiGluMlpImpl : public MlpImpl {
 public:
  SwiGluMlpImpl(int64_t hidden, int64_t ffn, bool bias);
  torch::Tensor forward(const torch::Tensor& x_BTD) const override;
  Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};

// Phi MLP: fc2(gelu_tanh(fc1(x))). HF's "gelu_new" writes the tanh formula out op by op; we use
// torch's fused gelu(approximate="tanh"), the same function (differences at fp32 rounding level,
// far below the 1e-4 logit tolerance) and one autograd node instead of eight.
class GeluMlpImpl : public MlpImpl {
 public:
  GeluMlpImpl(int64_t hidden, int64_t ffn, bool bias);
  torch::Tensor forward(const torch::Tensor& x_BTD) const override;
  Linear fc1{nullptr}, fc2{nullptr};
};

// Mixtral's sparse MoE block (HF MixtralSparseMoeBlock with experts_implementation="eager"): a
// router gate [X, D], softmax over the X experts (fp32), the top K renormalised to sum to 1; each
// expert e runs SwiGLU on the rows of the tokens routed to it,
//   rows_RD = x_MD[tok_R];  h = silu(rows W_gate_e^T) * (rows W_up_e^T);  out_RD = h W_down_e^T * w_R
// and adds them back, out_MD.index_add_(0, tok_R, out_RD) (M = B*T token rows, R = tokens routed
// to e). Parameters as HF: gate.weight [X, D], experts.gate_up_proj [X, 2F, D] (gate rows first),
// experts.down_proj [X, D, F]. An expert that receives no token runs on 0 rows (HF skips it), so
// that the autograd graph has the same nodes for every routing (a Collider plan replays nodes).
class MoeMlpImpl : public MlpImpl {
 public:
  MoeMlpImpl(int64_t hidden, int64_t ffn, int64_t num_experts, int64_t experts_per_token);
  torch::Tensor forward(const torch::Tensor& x_BTD) const override;
  Linear gate{nullptr};
  torch::Tensor gate_up_proj, down_proj;  // registered under "experts."
  int64_t experts_per_token;
};

class SelfAttentionImpl;  // attention.h

// One decoder layer: x_BTD -> x_BTD.
class DecoderLayerImpl : public torch::nn::Module {
 public:
  virtual torch::Tensor forward(const torch::Tensor& x_BTD, const ForwardContext& ctx) const = 0;
};

// Llama / Qwen2: h = x + attn(input_layernorm(x)); out = h + mlp(post_attention_layernorm(h)).
class SequentialBlockImpl : public DecoderLayerImpl {
 public:
  SequentialBlockImpl(std::shared_ptr<NormImpl> input_layernorm, std::shared_ptr<SelfAttentionImpl> self_attn,
                      std::shared_ptr<NormImpl> post_attention_layernorm, std::shared_ptr<MlpImpl> mlp);
  torch::Tensor forward(const torch::Tensor& x_BTD, const ForwardContext& ctx) const override;
  std::shared_ptr<NormImpl> input_layernorm, post_attention_layernorm;
  std::shared_ptr<SelfAttentionImpl> self_attn;
  std::shared_ptr<MlpImpl> mlp;
};

// Phi: one LayerNorm feeds attention and MLP; both are added to the residual:
// h = input_layernorm(x); out = attn(h) + mlp(h) + x (HF's order of additions).
class ParallelBlockImpl : public DecoderLayerImpl {
 public:
  ParallelBlockImpl(std::shared_ptr<NormImpl> input_layernorm, std::shared_ptr<SelfAttentionImpl> self_attn,
                    std::shared_ptr<MlpImpl> mlp);
  torch::Tensor forward(const torch::Tensor& x_BTD, const ForwardContext& ctx) const override;
  std::shared_ptr<NormImpl> input_layernorm;
  std::shared_ptr<SelfAttentionImpl> self_attn;
  std::shared_ptr<MlpImpl> mlp;
};

// The HF "model." submodule: embed_tokens, layers.{i}, final norm ("norm" or "final_layernorm").
class DecoderStackImpl : public torch::nn::Module {
 public:
  DecoderStackImpl() = default;
  Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers_list{nullptr};             // registered as "layers"
  std::vector<std::shared_ptr<DecoderLayerImpl>> layers;  // the same modules, typed
  std::shared_ptr<NormImpl> final_norm;                   // registered under the family's name
};

// Upcast dtype for norms and softmax: fp32, except that double stays double (gradient checks).
inline torch::ScalarType compute_dtype(torch::ScalarType t) {
  return t == torch::kDouble ? torch::kDouble : torch::kFloat;
}

}  // namespace collider::models::detail
