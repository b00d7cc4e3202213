// The key-rows edit (exact_query): the attention backward then runs with every key, so the
// gradient it sends into each key and value operand is [.., T, ..] while everything upstream of
// it runs on the kept rows. A KeyRowsNode on each key/value edge the plan marks (EdgeInsert)
// cuts that gradient to the kept rows, the padding rows of a ragged mask zeroed too (dropped
// tokens: their dK/dV are discarded); under the masked method it zeroes the dropped rows instead.
#include "edit.h"

namespace collider::detail {
namespace {

using torch::autograd::variable_list;

class KeyRowsNode final : public torch::autograd::Node {
 public:
  KeyRowsNode(std::shared_ptr<TokenIndex> index, ShapeSpec spec, bool zero_only)
      : index_(std::move(index)), spec_(std::move(spec)), zero_only_(zero_only) {}
  std::string name() const override { return zero_only_ ? "collider::MaskKeyRows" : "collider::CutKeyRows"; }
  variable_list apply(variable_list&& grads) override {
    torch::Tensor g = grads.at(0);
    if (!g.defined()) return {g};
    torch::NoGradGuard no_grad;
    if (zero_only_) return {index_->zero_dropped(g, spec_, true)};
    // Padding rows of ragged masks are dropped tokens: their dK/dV are discarded too.
    return {index_->zero_padding_into(index_->cut(g, spec_, /*cut_keys=*/true), g, spec_, /*keys_only=*/false)};
  }

 private:
  std::shared_ptr<TokenIndex> index_;
  ShapeSpec spec_;
  bool zero_only_;
};

class KeyRowsEdit final : public Edit {
 public:
  const char* name() const override { return "key rows"; }
  void after(const Graph& g, Transaction& tx) override {
    if (tx.cut_keys()) return;  // kept_only: the keys are cut with the queries
    for (const auto& ins : tx.plan().inserts) {
      const auto& parent = g.nodes[ins.node];
      const torch::autograd::Edge& e = parent->next_edge(ins.edge);
      if (!e.function) continue;  // K or V does not require grad
      const auto& meta = e.function->input_metadata(e.input_nr);
      const auto shape = to_ints(meta.shape_as_dim_vector());  // the full shape: nothing is written yet
      auto bad = tx.index().mismatch(shape, ins.shape);
      if (!bad.empty()) {
        throw Error(fmt::format("{}: the key/value gradient edge of node #{} does not match the plan: {}", tx.who(),
                                ins.node, bad));
      }
      if (tx.masked() && ins.shape.pad_rank != 0) {  // zero_dropped needs a batch dimension to mask by
        throw Error(
            fmt::format("{}: the key/value gradient of node #{} is shared by the batch's sequences (no "
                        "batch dimension), so their dropped rows cannot be masked apart; use "
                        "filter_backward, or attention=\"kept_only\"",
                        tx.who(), ins.node));
      }
      auto node = make_node<KeyRowsNode>(tx.shared_index(), ins.shape, tx.masked());
      node->add_input_metadata(meta.options(), to_syms(shape), false, false, std::nullopt);
      tx.insert_on_edge(parent, ins.edge, node);
      ++tx.stats().gather_nodes_inserted;
    }
  }
};

}  // namespace

std::unique_ptr<Edit> make_key_rows_edit() { return std::make_unique<KeyRowsEdit>(); }

}  // namespace collider::detail
