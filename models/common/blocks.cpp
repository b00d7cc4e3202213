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

MoeMlpImpl::MoeMlpImpl(int64_t hidden, int64_t ffn, int64_t num_experts, int64_t k) : experts_per_token(k) {
  gate = register_module("gate", Linear(hidden, num_experts, false));
  auto experts = register_module("experts", std::make_shared<torch::nn::Module>());
  gate_up_proj = experts->register_parameter("gate_up_proj", torch::zeros({num_experts, 2 * ffn, hidden}));
  down_proj = experts->register_parameter("down_proj", torch::zeros({num_experts, hidden, ffn}));
}

torch::Tensor MoeMlpImpl::forward(const torch::Tensor& x_BTD) const {
  const int64_t B = x_BTD.size(0), T = x_BTD.size(1), D = x_BTD.size(2), X = gate_up_proj.size(0);
  auto x_MD = x_BTD.reshape({B * T, D});
  auto probs_MX = torch::softmax(gate->forward(x_MD).to(compute_dtype(x_MD.scalar_type())), -1);
  auto [top_MK, expert_MK] = torch::topk(probs_MX, experts_per_token, -1);
  top_MK = top_MK / top_MK.sum(-1, /*keepdim=*/true);
  auto out_MD = torch::zeros_like(x_MD);
  // One view per expert, taken once: the experts' weight gradients come back as one stack
  // (UnbindBackward0). select(0, e) per expert would have its backward write a zero tensor of all
  // the experts' weights for each expert and the engine sum them: per layer 2 x X copies of the
  // stacked weights in every backward, a cost that does not shrink with the tokens.
  const auto gate_up_X = gate_up_proj.unbind(0);
  const auto down_X = down_proj.unbind(0);
  for (int64_t e = 0; e < X; ++e) {
    torch::Tensor tok_R, slot_R;  // the routed tokens' rows and their top-K slot
    {
      torch::NoGradGuard no_grad;
      // An expert that receives no token still runs, on 0 rows (HF skips it): the graph then has
      // the same nodes whatever the routing, which a plan needs.
      auto where_R2 = (expert_MK == e).nonzero();
      tok_R = where_R2.select(1, 0).contiguous();
      slot_R = where_R2.select(1, 1).contiguous();
    }
    auto rows_RD = x_MD.index({tok_R});
    auto gate_up = torch::nn::functional::linear(rows_RD, gate_up_X[e]).chunk(2, -1);
    auto h_RF = torch::silu(gate_up[0]) * gate_up[1];
    auto o_RD = torch::nn::functional::linear(h_RF, down_X[e]);
    o_RD = o_RD * top_MK.index({tok_R, slot_R}).unsqueeze(-1);
    out_MD.index_add_(0, tok_R, o_RD.to(out_MD.scalar_type()));
  }
  return out_MD.view({B, T, D});
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
