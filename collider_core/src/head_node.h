// Internal: the autograd node of the fused LM head (include/collider/head.h), and what the rewrite
// needs of it: which rows it kept and where their gradient goes. In plain autograd the node gives
// the hidden states a full-size gradient, zeros at the rows it dropped; the head edit
// (edits/head_rows.cpp) hands it a cut layout, and it then writes its K rows' gradient straight
// into the [B, N, D] (or [B*N, D]) rows the rest of the filtered backward expects.
// Legend: N hidden rows (B * T), D hidden, V vocabulary, K contributing rows (kept, target not
// ignore_index), B batch, T sequence, M = B * (kept per row after the cut).
#pragma once

#include <collider/head.h>

#include <torch/csrc/autograd/function.h>

#include <cstdint>
#include <string>
#include <vector>

namespace collider::detail {

class FusedHeadNode final : public torch::autograd::Node {
 public:
  // Where the hidden-state gradient goes: undefined slots_K, the full [N, D] rows (plain autograd,
  // mask_backward); else the K rows' slots in the cut rows [M] (filter_backward), shaped `sizes`.
  struct Layout {
    torch::Tensor slots_K;
    std::vector<int64_t> sizes;
  };
  // What the backward reads: the K contributing rows of the hidden states (a copy), their
  // log-sum-exp and targets, their rows in [N]; the weight and bias (detached: they share the
  // originals' version counters, checked in the backward).
  // Eager (fused_head_loss, where the keep mask is known in the forward): the K rows' gradients
  // were made in the forward for an upstream gradient of 1 (d_hidden_KD, d_weight_VD, d_bias_V, in
  // the accumulation dtype); the backward scales them, and nothing is recomputed.
  struct Saved {
    HeadOptions opts;
    double divisor = 1.0;
    torch::Tensor hidden_KD, lse_K, target_K, rows_K, keep, weight_VD, bias_V;
    bool eager = false;
    torch::Tensor d_hidden_KD, d_weight_VD, d_bias_V;
    c10::ScalarType accumulation = c10::ScalarType::Float;
    std::vector<int64_t> hidden_sizes;
    c10::ScalarType hidden_dtype = c10::ScalarType::Float;
  };

  explicit FusedHeadNode(Saved saved);
  std::string name() const override { return "collider::FusedHeadBackward"; }
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override;
  void release_variables() override;

  const torch::Tensor& keep() const { return s_.keep; }      // bool, the targets' shape
  const torch::Tensor& rows_K() const { return s_.rows_K; }  // int64 [K]: rows of [N], ascending
  const std::vector<int64_t>& hidden_sizes() const { return s_.hidden_sizes; }
  Layout& layout() { return layout_; }

 private:
  // The eager head's saved gradients times the upstream gradient.
  torch::autograd::variable_list emit(const torch::Tensor& upstream);
  // d_hidden_KD (the K rows) in the layout the hidden states' gradient goes in (layout_).
  torch::Tensor to_layout(const torch::Tensor& d_hidden_KD) const;
  Saved s_;
  uint32_t weight_version_ = 0, bias_version_ = 0;
  bool released_ = false;
  Layout layout_;
};

// Throws collider::Error (prefixed with `who`) for arguments the head cannot take.
void check_head_arguments(const char* who, const torch::Tensor& hidden, const torch::Tensor& weight,
                          const torch::Tensor& targets, const torch::Tensor& keep, const HeadOptions& opts,
                          const torch::Tensor& bias);

}  // namespace collider::detail
