// The leaf-rows edit: a leaf tensor with token dimensions (inputs_embeds that require grad; the
// embedding output that transformers' enable_input_require_grads marks when checkpointing a PEFT
// model) receives its gradient cut to the kept rows, but its AccumulateGrad expects (and its .grad
// holds) the leaf's full shape. A FullRowsNode on every edge into the AccumulateGrad puts the cut
// gradient back in the full layout, zero at every position the cut left out (the filtered
// semantics give dropped positions no gradient). The masked method's gradients are full-size
// already: it takes the node and leaves it as it is.
#include "edit.h"

namespace collider::detail {
namespace {

using torch::autograd::variable_list;

class FullRowsNode final : public torch::autograd::Node {
 public:
  FullRowsNode(std::shared_ptr<TokenIndex> index, ShapeSpec spec, bool cut_keys, std::vector<int64_t> full)
      : index_(std::move(index)), spec_(std::move(spec)), cut_keys_(cut_keys), full_(std::move(full)) {}
  std::string name() const override { return "collider::FullRows"; }
  variable_list apply(variable_list&& grads) override {
    torch::Tensor g = grads.at(0);
    if (!g.defined()) return {g};
    torch::NoGradGuard no_grad;
    return {index_->uncut(g, spec_, cut_keys_, full_)};
  }

 private:
  std::shared_ptr<TokenIndex> index_;
  ShapeSpec spec_;
  bool cut_keys_;
  std::vector<int64_t> full_;
};

class LeafRowsEdit final : public Edit {
 public:
  const char* name() const override { return "leaf rows"; }
  bool takes(const Graph&, int i, const Transaction& tx) const override {
    const NodeSpec& spec = tx.plan().nodes[i];
    return !spec.fields.empty() && traits_of(spec.type).leaf;
  }
  void cut(const Graph& g, int i, Transaction& tx) override {
    if (tx.masked()) return;
    const FieldSpec* in = tx.plan().nodes[i].find(FieldKind::kInputMeta, 0);
    if (!in || !in->shape.has_token()) return;
    const auto& meta = g.nodes[i]->input_metadata(0);
    auto full = to_ints(meta.shape_as_dim_vector());
    auto bad = tx.index().mismatch(full, in->shape);
    if (!bad.empty()) {
      throw Error(fmt::format("filter_backward: the leaf tensor of node #{} does not match the plan: {}", i, bad));
    }
    auto node = make_node<FullRowsNode>(tx.shared_index(), in->shape, tx.cut_keys(), full);
    node->add_input_metadata(meta.options(), to_syms(tx.index().cut_sizes(full, in->shape, tx.cut_keys())), false,
                             false, std::nullopt);
    node->add_next_edge(torch::autograd::Edge(g.nodes[i], 0));
    tx.replace_node(g, i, node);  // an AccumulateGrad's one input is input 0
    ++tx.stats().nodes_rewritten;
  }
};

}  // namespace

std::unique_ptr<Edit> make_leaf_rows_edit() { return std::make_unique<LeafRowsEdit>(); }

}  // namespace collider::detail
