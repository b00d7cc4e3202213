// The zero-padding edit: under a ragged keep mask the cut layout is [B, N] with N the largest kept
// count, and a shorter sequence's slots past its own count are padding. Their gradient must be
// zero, also where the loss does not mask them, so a ZeroPaddingNode is inserted where every
// token-shaped gradient is born: on each edge from a node without token-shaped inputs (the loss's
// reduction) into one with them (token_index.cpp says why this suffices). A node run whole zeroes
// them on its own edges (edits/run_whole.cpp).
#include "edit.h"

namespace collider::detail {
namespace {

using torch::autograd::variable_list;

class ZeroPaddingNode final : public torch::autograd::Node {
 public:
  ZeroPaddingNode(std::shared_ptr<TokenIndex> index, ShapeSpec spec)
      : index_(std::move(index)), spec_(std::move(spec)) {}
  std::string name() const override { return "collider::ZeroPadding"; }
  variable_list apply(variable_list&& grads) override {
    torch::Tensor g = std::move(grads.at(0));
    if (!g.defined()) return {g};
    torch::NoGradGuard no_grad;
    // A gradient only this node holds (the loss side's fresh [B*N, V] logits gradient) is zeroed
    // in place: out of place, transformers' labels loss paid 19 ms per step for a [1484, 8192]
    // copy (tinyllama-mini shapes, B = 4, T = 512, 2 CPU cores) against ~3 ms in place.
    const bool owned = g.use_count() == 1 && g.storage().use_count() == 1 && g.is_non_overlapping_and_dense();
    return {owned ? index_->zero_padding_in_place(g, spec_) : index_->zero_padding(g, spec_, /*keys_only=*/false)};
  }

 private:
  std::shared_ptr<TokenIndex> index_;
  ShapeSpec spec_;
};

class ZeroPaddingEdit final : public Edit {
 public:
  const char* name() const override { return "zero padding"; }
  void after(const Graph& g, Transaction& tx) override {
    if (!tx.index().ragged() || tx.masked()) return;
    const PlanData& data = tx.plan();
    auto token_input = [&](int node, uint32_t input_nr) -> const FieldSpec* {
      for (const auto& f : data.nodes[node].fields)
        if (f.kind == FieldKind::kInputMeta && f.item == static_cast<int32_t>(input_nr) && f.shape.has_token())
          return &f;
      return nullptr;
    };
    for (size_t i = 0; i < g.nodes.size(); ++i) {
      bool has_token_input = false;
      for (const auto& f : data.nodes[i].fields)
        has_token_input = has_token_input || (f.kind == FieldKind::kInputMeta && f.shape.has_token());
      if (has_token_input || data.nodes[i].fused_attention || data.nodes[i].run_whole) continue;
      const auto& edges = g.nodes[i]->next_edges();
      for (size_t e = 0; e < edges.size(); ++e) {
        if (!edges[e].function) continue;
        const int c = g.index.at(edges[e].function.get());
        const FieldSpec* f = token_input(c, edges[e].input_nr);
        if (!f) continue;
        const auto& meta = edges[e].function->input_metadata(edges[e].input_nr);
        auto shape = tx.index().cut_sizes(to_ints(meta.shape_as_dim_vector()), f->shape, tx.cut_keys());
        auto node = make_node<ZeroPaddingNode>(tx.shared_index(), f->shape);
        node->add_input_metadata(meta.options(), to_syms(shape), false, false, std::nullopt);
        tx.insert_on_edge(g.nodes[i], static_cast<int>(e), node);
      }
    }
  }
};

}  // namespace

std::unique_ptr<Edit> make_zero_padding_edit() { return std::make_unique<ZeroPaddingEdit>(); }

}  // namespace collider::detail
