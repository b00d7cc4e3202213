// Shared building blocks (see blocks.h): linear, embedding, norms, MLPs, decoder blocks.
// Every forward mirrors the Hugging Face transformers op sequence. Tested by tests/test_models.cpp.
// Legend: B batch, T sequence, D hidden, F ffn, V vocab.
#include "models/common/blocks.h"

#include "models/common/attention.h"

namespace collider::models::detail {

// Parameters start empty-valued (zeros); build_model / CausalLMImpl initialise them.
LinearImpl::LinearImpl(int64_t in_features, int64_t out_features, bool with_bias) {
  weight = register_parameter("weight", torch::zeros({out_features, in_features}));
  if (with_bias) bias = register_parameter("bias", torch::zeros({out_features}));
}

torch::Tensor LinearImpl::forward(const torch::Tensor& x) const {
  return torch::nn::functional::linear(x, weight, bias);
}

EmbeddingImpl::EmbeddingImpl(int64_t num_embeddings, int64_t dim) {
  weight = register_parameter("weight", torch::zeros({num_embeddings, dim}));
}

torch::Tensor EmbeddingImpl::forward(const torch::Tensor& ids_BT) const {
  TORCH_CHECK(ids_BT.scalar_type() == torch::kLong, "token ids must be int64, got ", ids_BT.scalar_type());
  return torch::embedding(weight, ids_BT);
}

RMSNormImpl::RMSNormImpl(int64_t dim, double eps_) : eps(eps_) {
  weight = register_parameter("weight", torch::ones({dim}));
}

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x_BTD) const {
  // HF: h = x.to(fp32); var = h.pow(2).mean(-1, keepdim); h = h * rsqrt(var + eps);
  //     return weight * h.to(input_dtype)
  const auto in_dtype = x_BTD.scalar_type();
  auto h = x_BTD.to(compute_dtype(in_dtype));
  auto var = h.pow(2).mean(-1, /*keepdim=*/true);
  h = h * torch::rsqrt(var + eps);
  return weight * h.to(in_dtype);
}

LayerNormImpl::LayerNormImpl(int64_t dim, double eps_) : eps(eps_) {
  weight = register_parameter("weight", torch::ones({dim}));
  bias = register_parameter("bias", torch::zeros({dim}));
}

torch::Tensor LayerNormImpl::forward(const torch::Tensor& x_BTD) const {
  return torch::layer_norm(x_BTD, {weight.size(0)}, weight, bias, eps);
}

SwiGluMlpImpl::SwiGluMlpImpl(int64_t hidden, int64_t ffn, bool bias) {
  gate_proj = register_module("gate_proj", Linear(hidden, ffn, bias));
  up_proj = register_module("up_proj", Linear(hidden, ffn, bias));
  down_proj = register_module("down_proj", Linear(ffn, hidden, bias));
}

torch::Tensor SwiGluMlpImpl::forward(const torch::Tensor& x_BTD) const {
  return down_proj->forward(torch::silu(gate_proj->forward(x_BTD)) * up_proj->forward(x_BTD));
}

GeluMlpImpl::GeluMlpImpl(int64_t hidden, int64_t ffn, bool bias) {
  fc1 = register_module("fc1", Linear(hidden, ffn, bias));
  fc2 = register_module("fc2", Linear(ffn, hidden, bias));
}

torch::Tensor GeluMlpImpl::forward(const torch::Tensor& x_BTD) const {
  return fc2->forward(torch::gelu(fc1->forward(x_BTD), "tanh"));
}

SequentialBlockImpl::SequentialBlockImpl(std::shared_ptr<NormImpl> in_norm, std::shared_ptr<SelfAttentionImpl> attn,
                                         std::shared_ptr<NormImpl> post_norm, std::shared_ptr<MlpImpl> mlp_) {
  self_attn = register_module("self_attn", std::move(attn));
  mlp = register_module("mlp", std::move(mlp_));
  input_layernorm = register_module("input_layernorm", std::move(in_norm));
  post_attention_layernorm = register_module("post_attention_layernorm", std::move(post_norm));
}

torch::Tensor SequentialBlockImpl::forward(const torch::Tensor& x_BTD, const ForwardContext& ctx) const {
  auto h_BTD = x_BTD + self_attn->forward(input_layernorm->forward(x_BTD), ctx);
  return h_BTD + mlp->forward(post_attention_layernorm->forward(h_BTD));
}

ParallelBlockImpl::ParallelBlockImpl(std::shared_ptr<NormImpl> in_norm, std::shared_ptr<SelfAttentionImpl> attn,
                                     std::shared_ptr<MlpImpl> mlp_) {
  self_attn = register_module("self_attn", std::move(attn));
  mlp = register_module("mlp", std::move(mlp_));
  input_layernorm = register_module("input_layernorm", std::move(in_norm));
}

torch::Tensor ParallelBlockImpl::forward(const torch::Tensor& x_BTD, const ForwardContext& ctx) const {
  auto h_BTD = input_layernorm->forward(x_BTD);
  auto attn_BTD = self_attn->forward(h_BTD, ctx);
  auto ff_BTD = mlp->forward(h_BTD);
  return attn_BTD + ff_BTD + x_BTD;  // HF PhiDecoderLayer: attn_outputs + feed_forward + residual
}

}  // namespace collider::models::detail
