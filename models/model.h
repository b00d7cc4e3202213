// The model interface every architecture implements: the causal LM module, per-token loss,
// boundary hooks (used for per-layer timing markers and gradient-shape probes). Its config and the
// presets are in models/model_config.h.
// Legend: B batch, T sequence, D hidden, H heads, G kv-heads, E head-dim, F ffn, V vocab,
// X experts, K experts per token.
// Parameter names follow Hugging Face (model.layers.3.self_attn.q_proj.weight, ...), so
// checkpoints map by name (models/hf_tensors.h).
#pragma once

#include "models/model_config.h"

#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

namespace collider::models {

namespace detail {
class DecoderStackImpl;  // models/common/blocks.h
class LinearImpl;
}  // namespace detail

// Called on the hidden states at every layer boundary, in forward order:
// "embedding" (output of the token embedding), "layer.00" ... (output of each decoder layer),
// "final_norm" (input of the LM head). Returns the tensor to continue with (identity, or an
// autograd marker / hook-carrying tensor). x_BTD: [B, T, D].
using BoundaryHook = std::function<torch::Tensor(const torch::Tensor& x_BTD, const std::string& name)>;

// What one layer's attention core is given: q_BHTE [B, H, T, E], k_BGTE and v_BGTE [B, G, T, E]
// after RoPE, causal_mask_TT bool [T, T] (true above the diagonal: masked), scale = E^-0.5, and
// the model's attention implementation.
struct AttentionCoreInputs {
  const torch::Tensor& q_BHTE;
  const torch::Tensor& k_BGTE;
  const torch::Tensor& v_BGTE;
  const torch::Tensor& causal_mask_TT;
  double scale;
  AttentionImpl impl;
};

// When set, computes every layer's attention core instead of the model (returns o_BHTE
// [B, H, T, E]). The tests install reference backward semantics here (tests/model_attention_oracle.h);
// unset, the model runs its own eager or SDPA core.
using AttentionHook = std::function<torch::Tensor(const AttentionCoreInputs& in)>;

class CausalLMImpl : public torch::nn::Module {
 public:
  CausalLMImpl(const ModelConfig& cfg, AttentionImpl attn);

  // input_ids_BT: int64 [B, T] -> logits_BTV (float, the LM head's dtype)
  torch::Tensor forward(const torch::Tensor& input_ids_BT);
  // Forward token dropping (the forward_drop method, DeepSpeed's random-LTD): the first and the
  // last decoder layer see every token; the middle layers (1 .. L-2) see only the tokens at
  // middle_BN, int64 [B, N], each row's positions strictly increasing in [0, T). Their hidden
  // states are gathered after layer 0 and scattered back before layer L-1; every other token
  // skips the middle layers (its state after layer 0 goes on unchanged). The middle layers keep
  // the tokens' original positions (RoPE) and causal order. Needs at least 3 decoder layers.
  // middle_BN's shape and dtype are always checked, its positions only when it is a CPU tensor
  // (on a device that check would cost a host sync per step; random_middle_tokens is valid).
  torch::Tensor forward(const torch::Tensor& input_ids_BT, const torch::Tensor& middle_BN);
  // The final hidden states x_BTD [B, T, D] (after the final norm): forward without the LM head,
  // for the fused head (collider/head.h), which takes them with head_weight() [V, D] (the
  // embedding matrix when tied) and head_bias() [V] (undefined unless the family has one).
  torch::Tensor hidden(const torch::Tensor& input_ids_BT, const torch::Tensor& middle_BN = {});
  const torch::Tensor& head_weight() const;
  torch::Tensor head_bias() const;

  const ModelConfig& config() const { return cfg_; }
  AttentionImpl attention_impl() const { return attn_; }
  void set_attention_impl(AttentionImpl a) { attn_ = a; }
  void set_boundary_hook(BoundaryHook hook) { hook_ = std::move(hook); }
  void set_attention_hook(AttentionHook hook) { attention_hook_ = std::move(hook); }
  // Re-initialises every parameter deterministically from `seed` (see build_model); the
  // constructor calls it with seed 0.
  void reset_parameters(uint64_t seed);

 protected:
  ModelConfig cfg_;
  AttentionImpl attn_;
  BoundaryHook hook_;
  AttentionHook attention_hook_;
  torch::Tensor boundary(const torch::Tensor& x_BTD, const std::string& name) {
    return hook_ ? hook_(x_BTD, name) : x_BTD;
  }
  friend struct ModelInternals;

 private:
  std::shared_ptr<detail::DecoderStackImpl> model_;  // HF "model.": embed_tokens, layers, final norm
  std::shared_ptr<detail::LinearImpl> lm_head_;      // HF "lm_head"; null when tied to embed_tokens
};
TORCH_MODULE(CausalLM);

// Builds the family's model with deterministic init from `seed` (GPT-2 style: normal(0, 0.02)
// for linear and embedding weights, zeros for biases, ones for norm weights), fp32 on CPU.
CausalLM build_model(const ModelConfig& cfg, AttentionImpl attn = AttentionImpl::kEager, uint64_t seed = 0);

// middle_BN for forward(input_ids, middle_BN): per row, N of the T positions drawn uniformly
// without replacement from `gen` (a CPU generator), sorted; int64 [B, N] on `device`.
torch::Tensor random_middle_tokens(int64_t B, int64_t T, int64_t N, torch::Generator& gen, torch::Device device);

// Per-token cross-entropy in nats: logits_BTV [B, T, V], labels_BT int64 [B, T] (pre-shifted:
// labels[t] is the token after position t; -100 = no label) -> loss_BT float [B, T] (0 where
// no label).
torch::Tensor token_losses(const torch::Tensor& logits_BTV, const torch::Tensor& labels_BT);

// Mean of loss_BT over kept positions (keep_BT bool [B, T]); the training loss of
// loss_only / collider / masked. With keep all-true it equals the regular loss.
torch::Tensor masked_mean_loss(const torch::Tensor& loss_BT, const torch::Tensor& keep_BT);

}  // namespace collider::models
