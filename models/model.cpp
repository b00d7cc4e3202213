// The causal LM shared by every family (model.h): construction from an Architecture, forward with
// boundary hooks, deterministic init, per-token loss, masked mean loss, analytic parameter count.
// Tested by tests/test_models.cpp.
// Legend: B batch, T sequence, D hidden, H heads, G kv-heads, E head dim, F ffn, V vocab.
#include "models/model.h"

#include "models/common/architecture.h"
#include "models/common/rotary.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <stdexcept>
#include <utility>

namespace collider::models {

// The family's word is its Hugging Face model_type (each family's file, HfMapping).
const char* to_string(Family f) { return detail::architecture(f).hf.model_type; }

namespace {
// The one table of attention implementations and their names.
constexpr std::pair<AttentionImpl, const char*> kAttentionImpls[] = {{AttentionImpl::kEager, "eager"},
                                                                     {AttentionImpl::kSdpa, "sdpa"}};
}  // namespace

const char* to_string(AttentionImpl a) {
  for (const auto& [impl, name] : kAttentionImpls)
    if (impl == a) return name;
  return "unknown";
}

const std::vector<std::string>& attention_impl_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> v;
    for (const auto& [impl, name] : kAttentionImpls) v.push_back(name);
    return v;
  }();
  return names;
}

AttentionImpl attention_impl_from_string(const std::string& s) {
  for (const auto& [impl, name] : kAttentionImpls)
    if (s == name) return impl;
  throw std::invalid_argument(
      fmt::format("unknown attention implementation '{}'; known: {}", s, fmt::join(attention_impl_names(), ", ")));
}

// Analytic count from the config; must equal the instantiated module's (tests/test_models.cpp).
int64_t ModelConfig::num_params() const {
  const auto& arch = detail::architecture(family);
  const int64_t D = hidden_size, F = intermediate_size, V = vocab_size;
  const int64_t qd = num_heads * head_dim, kvd = num_kv_heads * head_dim;
  const bool qkvb = qkv_bias || linear_bias;
  int64_t attn = D * qd + 2 * D * kvd + qd * D + (qkvb ? qd + 2 * kvd : 0) + (linear_bias ? D : 0);
  int64_t mlp = arch.mlp == detail::MlpKind::kSwiGLU ? 3 * D * F + (linear_bias ? 2 * F + D : 0)
                : arch.mlp == detail::MlpKind::kMoE  ? num_experts * D + num_experts * 3 * D * F  // router, experts
                                                     : 2 * D * F + (linear_bias ? F + D : 0);
  int64_t norm = arch.norm == detail::NormKind::kRMSNorm ? D : 2 * D;
  int64_t norms_per_layer = arch.block == detail::BlockKind::kSequential ? 2 : 1;
  int64_t layer = attn + mlp + norms_per_layer * norm;
  int64_t head = tie_embeddings ? 0 : V * D + (lm_head_bias ? V : 0);
  return V * D + num_layers * layer + norm + head;
}

CausalLMImpl::CausalLMImpl(const ModelConfig& cfg, AttentionImpl attn) : cfg_(cfg), attn_(attn) {
  detail::validate_config(cfg_);
  const auto& arch = detail::architecture(cfg_.family);
  model_ = register_module("model", std::make_shared<detail::DecoderStackImpl>());
  model_->embed_tokens = model_->register_module("embed_tokens", detail::Embedding(cfg_.vocab_size, cfg_.hidden_size));
  model_->layers_list = model_->register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < cfg_.num_layers; ++i) {
    auto layer = detail::build_decoder_layer(cfg_);
    model_->layers_list->push_back(layer);
    model_->layers.push_back(layer);
  }
  model_->final_norm = model_->register_module(arch.final_norm_name, detail::build_norm(cfg_));
  if (!cfg_.tie_embeddings)
    lm_head_ = register_module(
        "lm_head", std::make_shared<detail::LinearImpl>(cfg_.hidden_size, cfg_.vocab_size, cfg_.lm_head_bias));
  reset_parameters(0);
}

void CausalLMImpl::reset_parameters(uint64_t seed) {
  torch::NoGradGuard no_grad;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (auto& item : named_parameters(/*recurse=*/true)) {
    auto& p = item.value();
    const std::string& name = item.key();
    const bool is_bias = name.size() >= 5 && name.compare(name.size() - 5, 5, ".bias") == 0;
    if (is_bias) {
      p.zero_();
    } else if (p.dim() == 1) {
      p.fill_(1.0);  // norm weights
    } else if (p.device().is_cpu()) {
      p.normal_(0.0, 0.02, gen);
    } else {  // draw on CPU so that every device gets the same values
      p.copy_(torch::empty(p.sizes(), p.options().device(torch::kCPU)).normal_(0.0, 0.02, gen));
    }
  }
}

namespace {

// bool [T, T], true above the diagonal (the positions a query must not see), no grad.
torch::Tensor causal_mask(int64_t T, torch::Device device) {
  return torch::ones({T, T}, torch::TensorOptions().dtype(torch::kBool).device(device)).triu(1);
}

// The forward_drop token subset: int64 [B, N], 0 < N <= T, each row strictly increasing in [0, T).
// Shape and dtype are checked always. The positions themselves only when middle_BN lives on the
// CPU: reading a device tensor's values would synchronise the host with the device on every
// training step. Device subsets come from random_middle_tokens (valid by construction) in the
// harness; a caller building its own checks them on the CPU before moving them.
void check_middle_tokens(const torch::Tensor& middle_BN, int64_t B, int64_t T, int64_t num_layers) {
  TORCH_CHECK(num_layers >= 3,
              "forward token dropping needs at least 3 decoder layers (the first and the last see "
              "every token), this model has ",
              num_layers, "; use a preset with more layers");
  TORCH_CHECK(middle_BN.scalar_type() == torch::kLong && middle_BN.dim() == 2 && middle_BN.size(0) == B,
              "middle_BN must be an int64 [B, N] tensor with B = ", B, ", got ", middle_BN.scalar_type(), " ",
              middle_BN.sizes());
  const int64_t N = middle_BN.size(1);
  TORCH_CHECK(N > 0 && N <= T, "middle_BN must keep 1 to T = ", T, " tokens per row, got N = ", N);
  if (!middle_BN.device().is_cpu()) return;
  torch::NoGradGuard no_grad;
  const auto& m = middle_BN;
  TORCH_CHECK(m.min().item<int64_t>() >= 0 && m.max().item<int64_t>() < T, "middle_BN positions must lie in [0, ", T,
              "); got ", m.min().item<int64_t>(), " .. ", m.max().item<int64_t>());
  TORCH_CHECK(N == 1 || (m.slice(1, 1) > m.slice(1, 0, N - 1)).all().item<bool>(),
              "middle_BN rows must be strictly increasing positions (sorted, no repeats); random_middle_tokens "
              "draws such rows");
}

}  // namespace

torch::Tensor CausalLMImpl::forward(const torch::Tensor& input_ids_BT) { return forward(input_ids_BT, {}); }

torch::Tensor CausalLMImpl::forward(const torch::Tensor& input_ids_BT, const torch::Tensor& middle_BN) {
  const torch::Tensor x_BTD = hidden(input_ids_BT, middle_BN);
  if (lm_head_) return lm_head_->forward(x_BTD);
  return torch::nn::functional::linear(x_BTD, model_->embed_tokens->weight);  // tied head
}

const torch::Tensor& CausalLMImpl::head_weight() const {
  return lm_head_ ? lm_head_->weight : model_->embed_tokens->weight;
}

torch::Tensor CausalLMImpl::head_bias() const { return lm_head_ ? lm_head_->bias : torch::Tensor(); }

torch::Tensor CausalLMImpl::hidden(const torch::Tensor& input_ids_BT, const torch::Tensor& middle_BN) {
  TORCH_CHECK(input_ids_BT.dim() == 2, "input_ids must be [B, T], got shape ", input_ids_BT.sizes());
  const int64_t B = input_ids_BT.size(0), T = input_ids_BT.size(1);
  TORCH_CHECK(T > 0, "input_ids must hold at least one position per sequence");
  const auto L = static_cast<int64_t>(model_->layers.size());
  if (middle_BN.defined()) check_middle_tokens(middle_BN, B, T, L);
  auto x_BTD = boundary(model_->embed_tokens->forward(input_ids_BT), "embedding");

  detail::ForwardContext ctx;
  ctx.attn = attn_;
  ctx.attention_hook = attention_hook_ ? &attention_hook_ : nullptr;
  {
    torch::NoGradGuard no_grad;
    ctx.causal_mask_TT = causal_mask(T, x_BTD.device());
    std::tie(ctx.cos_TR, ctx.sin_TR) =
        detail::rotary_tables(T, detail::rotary_dim(cfg_), cfg_.rope_theta, x_BTD.scalar_type(), x_BTD.device());
  }
  auto layer = [&](int64_t i, const torch::Tensor& x, const detail::ForwardContext& c) {
    return boundary(model_->layers[i]->forward(x, c), fmt::format("layer.{:02d}", i));
  };
  if (!middle_BN.defined()) {
    for (int64_t i = 0; i < L; ++i) x_BTD = layer(i, x_BTD, ctx);
  } else {
    const int64_t N = middle_BN.size(1), D = x_BTD.size(2);
    const auto mid_BN = middle_BN.to(x_BTD.device());  // one copy (none when already there)
    x_BTD = layer(0, x_BTD, ctx);
    auto idx_BND = mid_BN.unsqueeze(-1).expand({B, N, D});
    auto x_BND = x_BTD.gather(1, idx_BND);
    detail::ForwardContext mid = ctx;  // the middle layers' tokens: N per row at their own positions
    {
      torch::NoGradGuard no_grad;
      // Sorted positions keep causal order, so the N x N causal mask is exact.
      mid.causal_mask_TT = causal_mask(N, x_BTD.device());
      const auto flat_BN = mid_BN.reshape({B * N});
      mid.cos_TR = ctx.cos_TR.index_select(0, flat_BN).view({B, N, -1});
      mid.sin_TR = ctx.sin_TR.index_select(0, flat_BN).view({B, N, -1});
    }
    for (int64_t i = 1; i + 1 < L; ++i) x_BND = layer(i, x_BND, mid);
    x_BTD = layer(L - 1, x_BTD.scatter(1, idx_BND, x_BND), ctx);
  }
  return boundary(model_->final_norm->forward(x_BTD), "final_norm");
}

torch::Tensor random_middle_tokens(int64_t B, int64_t T, int64_t N, torch::Generator& gen, torch::Device device) {
  TORCH_CHECK(B > 0 && T > 0 && N > 0 && N <= T, "random_middle_tokens needs B > 0 and 0 < N <= T, got B ", B, ", T ",
              T, ", N ", N);
  torch::NoGradGuard no_grad;
  // One uniform key per position, the N smallest per row: a uniform N-subset of each row.
  auto keys_BT = torch::rand({B, T}, gen, torch::TensorOptions().dtype(torch::kFloat));
  auto idx_BN = std::get<1>(keys_BT.topk(N, /*dim=*/1, /*largest=*/false, /*sorted=*/false));
  return std::get<0>(idx_BN.sort(1)).to(device);
}

CausalLM build_model(const ModelConfig& cfg, AttentionImpl attn, uint64_t seed) {
  CausalLM model(cfg, attn);
  if (seed != 0) model->reset_parameters(seed);
  return model;
}

torch::Tensor token_losses(const torch::Tensor& logits_BTV, const torch::Tensor& labels_BT) {
  TORCH_CHECK(logits_BTV.dim() == 3, "logits must be [B, T, V], got shape ", logits_BTV.sizes());
  TORCH_CHECK(
      labels_BT.dim() == 2 && labels_BT.size(0) == logits_BTV.size(0) && labels_BT.size(1) == logits_BTV.size(1),
      "labels must be [B, T] matching logits ", logits_BTV.sizes(), ", got ", labels_BT.sizes());
  TORCH_CHECK(labels_BT.scalar_type() == torch::kLong, "labels must be int64, got ", labels_BT.scalar_type());
  const int64_t B = logits_BTV.size(0), T = logits_BTV.size(1), V = logits_BTV.size(2);
  auto logp_BTV = torch::log_softmax(logits_BTV, -1, detail::compute_dtype(logits_BTV.scalar_type()));
  auto loss_N = torch::nll_loss(logp_BTV.reshape({B * T, V}), labels_BT.reshape({B * T}), {}, at::Reduction::None,
                                /*ignore_index=*/-100);
  return loss_N.view({B, T});
}

torch::Tensor masked_mean_loss(const torch::Tensor& loss_BT, const torch::Tensor& keep_BT) {
  TORCH_CHECK(keep_BT.scalar_type() == torch::kBool, "keep mask must be bool, got ", keep_BT.scalar_type());
  TORCH_CHECK(keep_BT.sizes() == loss_BT.sizes(), "keep mask ", keep_BT.sizes(), " must match the loss ",
              loss_BT.sizes());
  // No check that keep has a true entry: that would synchronise the device every step; an
  // all-false mask gives NaN, and select_tokens never returns one.
  return (loss_BT * keep_BT.to(loss_BT.scalar_type())).sum() / keep_BT.sum();
}

}  // namespace collider::models
