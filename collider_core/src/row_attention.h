// Internal: ragged kept counts under eager attention. One node that stands in for a whole
// attention core (QK^T -> scale/mask -> softmax -> PV) and computes its backward one sequence row
// at a time on that row's own kept count, instead of on [B, H, N, N] padded to the largest count.
// Like every other cut (saved_cut.h), its rows are cut from the forward's tensors when its backward
// first runs, not in filter_backward, and each full tensor goes as soon as its rows are cut.
// Used by the rewrite for ragged masks (edits/attention_rows.cpp); row_attention.cpp says why and what it costs.
#pragma once

#include "attention_cores.h"
#include "graph.h"
#include "plan_impl.h"
#include "token_index.h"

#include "collider/torch_compat.h"

#include <array>
#include <memory>
#include <string>

namespace collider::detail {

// The stand-in for `core`, or nullptr with *why_not set when this core cannot run per row (an op
// in its chains that the stand-in does not replay, a probability used elsewhere, ...): the
// padded path then runs it, with the same gradients. Holds the saved tensors it needs, to be cut
// in its backward; changes nothing in the graph. Its input is the PV output's gradient in the padded layout; its
// next edges, taken by adopt_edges() once the rewrite is written, are QK^T's two and PV's second.
class RowAttentionNode;
NodePtrOf<RowAttentionNode> make_row_attention(const Graph& g, const PlanData& plan,
                                                     const AttentionCoreNodes& core, TokenIndex& index,
                                                     const std::shared_ptr<TokenIndex>& shared_index, bool exact,
                                                     std::string* why_not);

class RowAttentionNode final : public torch::autograd::Node {
 public:
  struct Row {
    torch::Tensor live;             // int64 [N_b]: the row's slots in the padded layout
    torch::Tensor p, r, v, q, k_t;  // [H, N_b, N_b or T] (PV's P, softmax's result), [H, ., E] x2, [H, E, .]
  };
  // The forward's saved tensors, [B*H, T, ..], and the plan's shape of each: cut row by row on the
  // backward's first call, then let go.
  struct Saved {
    torch::Tensor p, r, v, q, k_t;  // r undefined when it is p (one cut serves both)
    ShapeSpec p_shape, v_shape, q_shape, k_shape;
    std::vector<uint32_t> versions;  // of p, r, v, q, k_t when held: a change in place is refused
    // The five tensors, each with the plan shape it is cut by, in the order of `versions`.
    std::array<std::pair<const torch::Tensor*, const ShapeSpec*>, 5> held() const {
      return {{{&p, &p_shape}, {&r, &p_shape}, {&v, &v_shape}, {&q, &q_shape}, {&k_t, &k_shape}}};
    }
  };
  struct Scale {  // one step of the score chain, softmax -> QK^T, applied to the gradient in order
    enum Kind { kMul, kDiv, kCast } kind;
    torch::Tensor factor;  // kMul, kDiv: one element
    c10::ScalarType dtype;  // kCast
  };

  RowAttentionNode(std::shared_ptr<TokenIndex> index, Saved saved, std::vector<Scale> chain,
                   c10::ScalarType softmax_input_dtype, int64_t heads, bool exact, NodePtr qk,
                   NodePtr pv);
  std::string name() const override { return "collider::RowAttention"; }
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override;
  // After its backward (unless the graph is retained): the rows' cut tensors are freed, as the
  // replaced nodes would have freed theirs.
  void release_variables() override {
    rows_.clear();
    saved_ = {};
    released_ = true;
  }
  // The bytes of each tensor its backward will cut (the rewrite's gather statistics).
  std::vector<int64_t> cut_bytes() const;
  // QK^T's next edges (Q, K^T) and PV's second (V), read after every other edge write.
  void adopt_edges();

 private:
  void cut_rows();  // rows_ from saved_, on the first backward

  std::shared_ptr<TokenIndex> ix_;
  Saved saved_;
  std::vector<Row> rows_;
  bool released_ = false;
  std::vector<Scale> chain_;
  c10::ScalarType softmax_input_dtype_;
  int64_t H_;
  bool exact_;
  NodePtr qk_, pv_;
};

}  // namespace collider::detail
