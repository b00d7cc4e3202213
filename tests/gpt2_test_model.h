// A GPT-2-style model defined only inside the tests (LayerNorm, learned positions, fused QKV
// split with chunk, GELU, tied head), to show the rewriter is not tied to our model code, and
// the reference attention semantics of DESIGN.md section 3 written out directly, for oracles.
// Legend: B batch, T sequence, D hidden, H heads, E head-dim, V vocab.
#pragma once

#include "attention_oracle.h"

#include <torch/torch.h>

#include <cmath>
#include <optional>

namespace collider::testing {

// kept_only oracle: ordinary attention forward; backward by the section-3 formulas on full-size
// tensors with dropped rows and columns zeroed. q,k,v: [B, H, T, E]; keep: float [B, 1, T, 1].
struct KeptOnlyAttention : public torch::autograd::Function<KeptOnlyAttention> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor q, torch::Tensor k, torch::Tensor v,
                               torch::Tensor keep_B1T1) {
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
    const int64_t T = q.size(2);
    auto causal = torch::ones({T, T}, q.options().dtype(torch::kBool)).triu(1);
    auto p = torch::softmax((q.matmul(k.transpose(-2, -1)) * scale).masked_fill(causal, -INFINITY), -1);
    ctx->save_for_backward({q, k, v, p, keep_B1T1});
    ctx->saved_data["scale"] = scale;
    return p.matmul(v);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto s = ctx->get_saved_variables();
    auto q = s[0], k = s[1], v = s[2], p = s[3], keep = s[4];
    const double scale = ctx->saved_data["scale"].toDouble();
    auto keep_cols = keep.transpose(-2, -1);  // [B, 1, 1, T]
    auto pm = p * keep * keep_cols;           // P restricted to kept rows and columns
    auto dO = grads[0] * keep;
    auto dV = pm.transpose(-2, -1).matmul(dO);
    auto dP = dO.matmul(v.transpose(-2, -1));
    auto dS = pm * (dP - (dP * pm).sum(-1, true));
    auto dQ = dS.matmul(k) * scale;
    auto dK = dS.transpose(-2, -1).matmul(q) * scale;
    return {dQ, dK, dV, torch::Tensor()};
  }
};

struct Gpt2Impl : torch::nn::Module {
  int64_t V, D, H, L, max_T;
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  std::vector<torch::nn::LayerNorm> ln1, ln2;
  std::vector<torch::nn::Linear> qkv, proj, fc, fc_out;
  torch::nn::LayerNorm ln_f{nullptr};
  std::optional<AttentionOracle> oracle;
  bool use_sdpa = false;  // fused torch::scaled_dot_product_attention instead of the explicit graph
  // What a Hugging Face model with use_cache left on does at its first step: K and V are
  // concatenated onto an empty cache [B, H, 0, E] along the sequence.
  bool empty_kv_cache = false;
  // With use_sdpa: this layer passes an explicit causal mask [T, T] instead of is_causal (the same
  // attention, through the fused kernel's mask).
  int64_t explicit_mask_layer = -1;

  std::function<torch::Tensor(const torch::Tensor&, int)> hook;  // on the residual after each block

  Gpt2Impl(int64_t vocab, int64_t dim, int64_t heads, int64_t layers, int64_t max_seq)
      : V(vocab), D(dim), H(heads), L(layers), max_T(max_seq) {
    wte = register_module("wte", torch::nn::Embedding(V, D));
    wpe = register_module("wpe", torch::nn::Embedding(max_T, D));
    for (int64_t l = 0; l < L; ++l) {
      auto p = "h" + std::to_string(l) + "_";
      ln1.push_back(register_module(p + "ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({D}))));
      qkv.push_back(register_module(p + "qkv", torch::nn::Linear(D, 3 * D)));
      proj.push_back(register_module(p + "proj", torch::nn::Linear(D, D)));
      ln2.push_back(register_module(p + "ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({D}))));
      fc.push_back(register_module(p + "fc", torch::nn::Linear(D, 4 * D)));
      fc_out.push_back(register_module(p + "fc_out", torch::nn::Linear(4 * D, D)));
    }
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({D})));
  }

  torch::Tensor attention(const torch::Tensor& x_BTD, int64_t l) {
    const int64_t B = x_BTD.size(0), T = x_BTD.size(1), E = D / H;
    auto parts = qkv[l]->forward(x_BTD).chunk(3, -1);
    auto q = parts[0].view({B, T, H, E}).transpose(1, 2);
    auto k = parts[1].view({B, T, H, E}).transpose(1, 2);
    auto v = parts[2].view({B, T, H, E}).transpose(1, 2);
    if (empty_kv_cache) {
      auto empty = torch::zeros({B, H, 0, E}, k.options());
      k = torch::cat({empty, k}, 2);
      v = torch::cat({empty, v}, 2);
    }
    torch::Tensor o;
    if (oracle && !oracle->exact_query) {
      auto keep = oracle->keep_BT.to(x_BTD.scalar_type()).view({B, 1, T, 1});
      o = KeptOnlyAttention::apply(q, k, v, keep);
    } else if (use_sdpa && !oracle && l == explicit_mask_layer) {
      auto attend = torch::ones({T, T}, x_BTD.options().dtype(torch::kBool)).tril();
      o = torch::scaled_dot_product_attention(q, k, v, attend, 0.0, /*is_causal=*/false);
    } else if (use_sdpa && !oracle) {
      o = torch::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
    } else {
      if (oracle) {  // exact_query: K and V of dropped tokens detached
        auto keep = oracle->keep_BT.view({B, 1, T, 1});
        k = torch::where(keep, k, k.detach());
        v = torch::where(keep, v, v.detach());
      }
      auto causal = torch::ones({T, T}, x_BTD.options().dtype(torch::kBool)).triu(1);
      auto att = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(E)));
      att = torch::softmax(att.masked_fill(causal, -INFINITY), -1);
      o = torch::matmul(att, v);
    }
    return proj[l]->forward(o.transpose(1, 2).reshape({B, T, D}));
  }

  torch::Tensor forward(const torch::Tensor& idx_BT) { return torch::matmul(hidden(idx_BT), wte->weight.t()); }  // tied head

  // The final hidden states [B, T, D], the LM head's input.
  torch::Tensor hidden(const torch::Tensor& idx_BT) {
    const int64_t T = idx_BT.size(1);
    auto pos = torch::arange(T, idx_BT.options());
    auto x = wte->forward(idx_BT) + wpe->forward(pos);
    for (int64_t l = 0; l < L; ++l) {
      x = x + attention(ln1[l]->forward(x), l);
      x = x + fc_out[l]->forward(torch::gelu(fc[l]->forward(ln2[l]->forward(x))));
      if (hook) x = hook(x, static_cast<int>(l));
    }
    return ln_f->forward(x);
  }
};
TORCH_MODULE(Gpt2);

}  // namespace collider::testing
