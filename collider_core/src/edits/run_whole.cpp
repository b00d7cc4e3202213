// The run-whole edit: a node that cannot be cut row by row (NodeSpec::run_whole: a scan, a short
// convolution, a slice or scatter along the tokens, an op its row rule does not cut) keeps its
// saved tensors and runs its backward at full size. A WholeRowsNode in front of it puts the kept
// rows' gradient back in the full layout, zero at every dropped position (the filtered semantics
// give dropped positions no gradient), and a CutRowsNode on each of its edges into a token-shaped
// gradient cuts what it sends back to the kept rows: the dropped rows are detached at the node's
// inputs (DESIGN.md section 3), the rule exact_query applies to attention's keys and values. The
// masked method's gradients are full-size: it zeroes the dropped rows on those edges instead.
#include "edit.h"

namespace collider::detail {
namespace {

using torch::autograd::variable_list;

// A gradient the node receives with token rows: its plan shape and full sizes (full empty: a gradient
// without token rows, passed as it is).
struct GradientShape {
  ShapeSpec spec;
  std::vector<int64_t> full;
};

// In front of the node: each token-shaped gradient it receives, from the kept rows to full size (the
// masked method's is full-size already: its dropped rows zeroed).
class WholeRowsNode final : public torch::autograd::Node {
 public:
  WholeRowsNode(std::shared_ptr<TokenIndex> index, std::vector<GradientShape> inputs, bool cut_keys, bool masked)
      : index_(std::move(index)), inputs_(std::move(inputs)), cut_keys_(cut_keys), masked_(masked) {}
  std::string name() const override { return masked_ ? "collider::MaskedWholeRows" : "collider::WholeRows"; }
  variable_list apply(variable_list&& grads) override {
    torch::NoGradGuard no_grad;
    for (size_t k = 0; k < grads.size(); ++k) {
      if (!grads[k].defined() || inputs_[k].full.empty()) continue;
      grads[k] = masked_ ? index_->zero_dropped(grads[k], inputs_[k].spec, cut_keys_)
                         : index_->uncut(grads[k], inputs_[k].spec, cut_keys_, inputs_[k].full);
    }
    return std::move(grads);
  }

 private:
  std::shared_ptr<TokenIndex> index_;
  std::vector<GradientShape> inputs_;
  bool cut_keys_;
  bool masked_;
};

// On an edge out of the node into a token-shaped gradient: its dropped rows detached (cut away, or
// zeroed under the masked method), the padding rows of a ragged mask zeroed too.
class CutRowsNode final : public torch::autograd::Node {
 public:
  CutRowsNode(std::shared_ptr<TokenIndex> index, ShapeSpec spec, bool cut_keys, bool masked)
      : index_(std::move(index)), spec_(std::move(spec)), cut_keys_(cut_keys), masked_(masked) {}
  std::string name() const override { return masked_ ? "collider::MaskWholeRows" : "collider::CutWholeRows"; }
  variable_list apply(variable_list&& grads) override {
    torch::Tensor g = grads.at(0);
    if (!g.defined()) return {g};
    torch::NoGradGuard no_grad;
    if (masked_) return {index_->zero_dropped(g, spec_, cut_keys_)};
    return {index_->zero_padding_into(index_->cut(g, spec_, cut_keys_), g, spec_, /*keys_only=*/false)};
  }

 private:
  std::shared_ptr<TokenIndex> index_;
  ShapeSpec spec_;
  bool cut_keys_;
  bool masked_;
};

class RunWholeEdit final : public Edit {
 public:
  const char* name() const override { return "run whole"; }
  bool takes(const Graph&, int i, const Transaction& tx) const override { return tx.plan().nodes[i].run_whole; }
  void cut(const Graph& g, int i, Transaction& tx) override {
    const NodePtr& node = g.nodes[i];
    const NodeSpec& ns = tx.plan().nodes[i];
    ++tx.stats().nodes_run_whole;
    put_in_front(g, i, node, ns, tx);
    const auto& edges = node->next_edges();
    for (size_t e = 0; e < edges.size(); ++e) {
      if (!edges[e].function) continue;
      const int child = g.index.at(edges[e].function.get());
      const FieldSpec* in = tx.plan().nodes[child].find(FieldKind::kInputMeta, static_cast<int32_t>(edges[e].input_nr));
      if (!in || !token_rows(in->shape, tx, i)) continue;  // a gradient without token rows: full-size on both sides
      const auto& meta = edges[e].function->input_metadata(edges[e].input_nr);
      const auto full = checked_full(meta, in->shape, tx, child);
      auto cut = make_node<CutRowsNode>(tx.shared_index(), in->shape, tx.cut_keys(), tx.masked());
      cut->add_input_metadata(meta.options(), to_syms(full), false, false, std::nullopt);
      tx.insert_on_edge(node, static_cast<int>(e), cut);
    }
  }

 private:
  // Whether a gradient at the node's border has token rows, which the cut changes. T + c positions (a
  // convolution's padding) are not token rows: full-size on both sides, as the node runs.
  static bool token_rows(const ShapeSpec& spec, const Transaction& tx, int node) {
    bool rows = false, plus = false;
    for (const auto& d : spec.dims) {
      if (d.kind == DimKind::kTokenPlus) plus = true;
      else if (d.kind != DimKind::kBatch) rows = true;
    }
    if ((rows && plus) || spec.has_routed()) {
      throw Error(fmt::format("{}: node #{} runs whole (it cannot be cut row by row), and a gradient at its border "
                              "holds {}; collider cannot put its kept rows back. Write the model without that op, "
                              "or train it without token filtering",
                              tx.who(), node, spec.has_routed() ? "a mixture-of-experts route" : "T and T + c positions"));
    }
    return rows;
  }

  // The node's full sizes of a gradient the plan marks token-shaped, checked against the plan.
  static std::vector<int64_t> checked_full(const torch::autograd::InputMetadata& meta, const ShapeSpec& spec,
                                           const Transaction& tx, int node) {
    auto full = to_ints(meta.shape_as_dim_vector());
    auto bad = tx.index().mismatch(full, spec);
    if (!bad.empty()) {
      throw Error(fmt::format("{}: the gradient into node #{} does not match the plan: {}", tx.who(), node, bad));
    }
    if (c10::isComplexType(c10::typeMetaToScalarType(meta.options().dtype())) && tx.index().ragged()) {
      // Not yet exact: a ragged mask's padding slots and a complex gradient (an FFT along the tokens) gave a
      // gradient that differs from mask_backward's; refused until that is found.
      throw Error(fmt::format("{}: node #{} runs whole (it cannot be cut row by row) with a complex gradient at its "
                              "border, which collider does not cut under ragged kept counts; use a per_sequence keep "
                              "mask, or mask_backward",
                              tx.who(), node));
    }
    if (spec.pad_rank != 0) {
      throw Error(fmt::format("{}: node #{} runs whole (it cannot be cut row by row) and a gradient at its border "
                              "is shared by the batch's sequences (no batch dimension), so its kept rows cannot be "
                              "put back apart; write the model without that op, or train it without token filtering",
                              tx.who(), node));
    }
    return full;
  }

  // A WholeRowsNode in front of the node when it receives a token-shaped gradient.
  static void put_in_front(const Graph& g, int i, const NodePtr& node, const NodeSpec& ns, Transaction& tx) {
    std::vector<GradientShape> inputs(node->num_inputs());
    bool any = false;
    for (uint32_t k = 0; k < node->num_inputs(); ++k) {
      const FieldSpec* in = ns.find(FieldKind::kInputMeta, static_cast<int32_t>(k));
      if (!in || !token_rows(in->shape, tx, i)) continue;
      inputs[k] = GradientShape{in->shape, checked_full(node->input_metadata(k), in->shape, tx, i)};
      any = true;
    }
    if (!any) return;
    auto front = make_node<WholeRowsNode>(tx.shared_index(), inputs, tx.cut_keys(), tx.masked());
    for (uint32_t k = 0; k < node->num_inputs(); ++k) {
      const auto& meta = node->input_metadata(k);
      auto full = to_ints(meta.shape_as_dim_vector());
      auto sizes = inputs[k].full.empty() || tx.masked() ? full
                                                         : tx.index().cut_sizes(full, inputs[k].spec, tx.cut_keys());
      front->add_input_metadata(meta.options(), to_syms(sizes), false, false, std::nullopt);
      front->add_next_edge(torch::autograd::Edge(node, k));
    }
    tx.replace_node(g, i, front);
  }
};

}  // namespace

std::unique_ptr<Edit> make_run_whole_edit() { return std::make_unique<RunWholeEdit>(); }

}  // namespace collider::detail
