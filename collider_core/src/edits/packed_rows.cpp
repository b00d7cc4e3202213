// The packed-rows edit: under a ragged keep mask, the backward of a GEMM over the token rows,
// y = x @ W (MmBackward0) or y = b + x @ W (AddmmBackward0) with x the [B*T, D] rows of the
// tokens, runs on the S = sum_b N_b packed kept rows instead of the B*N padded ones
// (token_index.cpp says why). The original node keeps its place in memory, its token operand and
// sizes cut to the S packed rows (the field cut, packed); a PackedRowsNode stands in for it in the
// graph: it takes the padded gradient [B*N, Dout], keeps its live rows (padding rows carry zero
// gradient), calls the original node, and returns its token-operand gradient [S, D] in the padded
// layout with zero padding rows. Both GEMMs (dX = dY W^T, dW = X^T dY) then cost what the kept
// tokens cost; the result is the padded one's. A GEMM feeding another such GEMM stays padded.
#include "edit.h"

#include "field_cut.h"

#include "../cpu_kernels.h"

namespace collider::detail {
namespace {

using torch::autograd::variable_list;

class PackedRowsNode final : public torch::autograd::Node {
 public:
  PackedRowsNode(NodePtr inner, size_t token_output, std::shared_ptr<TokenIndex> index)
      : Node(inner->sequence_nr()), inner_(std::move(inner)), token_output_(token_output), index_(std::move(index)) {}
  std::string name() const override { return "collider::PackedRows"; }
  void release_variables() override { inner_->release_variables(); }
  // The original node's edges, taken after every other edge write of the rewrite (commit).
  void adopt_edges() {
    next_edges_ = inner_->next_edges();
    topological_nr_ = inner_->topological_nr();
  }
  variable_list apply(variable_list&& grads) override {
    torch::Tensor g = grads.at(0);
    if (!g.defined()) return (*inner_)(std::move(grads));
    {
      torch::NoGradGuard no_grad;
      g = gather_rows(g, index_->live_rows(), /*stream=*/false);  // [S, Dout], read by the GEMM next
    }
    variable_list outs = (*inner_)({g});
    torch::Tensor& dx = outs.at(token_output_);  // [S, D]
    if (dx.defined()) {
      torch::NoGradGuard no_grad;
      // live rows copied, padding rows zeroed: one pass over the output, not a memset and a copy
      dx = scatter_rows(dx.contiguous(), index_->live_rows(), index_->padding_rows(), index_->B() * index_->N());
    }
    return outs;
  }

 private:
  NodePtr inner_;
  size_t token_output_;
  std::shared_ptr<TokenIndex> index_;
};

// The next_edge of a GEMM node whose backward can run on packed rows: the token operand's, when
// it is the node's only token-shaped field, a plain [B*T, D] matrix; else -1.
int packed_token_output(const NodeSpec& spec) {
  const NodeTraits traits = traits_of(spec.type);
  const char* field = traits.packed_operand;
  if (!field) return -1;
  bool saved = false;
  for (const auto& f : spec.fields) {
    const ShapeSpec& s = f.shape;
    if (s.rank != 2 || s.pad_rank != 0 || s.dims.size() != 1 || s.dims[0].dim != 0 ||
        s.dims[0].kind != DimKind::kFlatToken || s.dims[0].mult != 1) {
      return -1;
    }
    if (f.kind == FieldKind::kSaved) {
      if (f.name != field) return -1;  // the weight operand is token-shaped: not a token-row GEMM
      saved = true;
    }
  }
  if (!saved) return -1;
  return traits.packed_edge;
}

class PackedRowsEdit final : public Edit {
 public:
  const char* name() const override { return "packed rows"; }

  // The token-row GEMMs that run on packed rows (none of them feeding another).
  void before(const Graph& g, Transaction& tx, std::vector<char>&) override {
    const auto& nodes = tx.plan().nodes;
    output_.assign(nodes.size(), -1);
    if (!tx.index().ragged() || tx.masked()) return;
    for (size_t i = 0; i < nodes.size(); ++i) output_[i] = packed_token_output(nodes[i]);
    for (size_t i = 0; i < nodes.size(); ++i) {
      if (output_[i] < 0) continue;
      for (const auto& e : g.nodes[i]->next_edges()) {
        auto it = e.function ? g.index.find(e.function.get()) : g.index.end();
        if (it != g.index.end() && output_[it->second] >= 0) output_[i] = -1;
      }
    }
  }

  bool takes(const Graph&, int i, const Transaction& tx) const override {
    return !tx.plan().nodes[i].fields.empty() && output_[i] >= 0;
  }

  // Its fields cut to the packed rows, a PackedRowsNode put in its place (every edge into it leads
  // to the stand-in; its input is the padded [B*N, Dout]).
  void cut(const Graph& g, int i, Transaction& tx) override {
    const NodePtr& node = g.nodes[i];
    const NodeSpec& spec = tx.plan().nodes[i];
    FieldCut apply(tx, node, spec, i, /*packed=*/true);
    if (const NodeFields* nf = find_node_fields(*node)) nf->visit(node.get(), apply);
    apply.inputs();
    const FieldSpec* in = spec.find(FieldKind::kInputMeta, 0);
    if (!in || node->num_inputs() != 1) {
      throw Error(fmt::format("filter_backward: node #{} {} has no token-shaped input (plan bug)", i, spec.type));
    }
    const auto& meta = node->input_metadata(0);
    auto stand_in = make_node<PackedRowsNode>(node, static_cast<size_t>(output_[i]), tx.shared_index());
    stand_in->add_input_metadata(
        meta.options(), to_syms(tx.index().cut_sizes(to_ints(meta.shape_as_dim_vector()), in->shape, tx.cut_keys())),
        false, false, std::nullopt);
    tx.replace_node(g, i, stand_in);
    tx.stand_in(node.get(), stand_in);
    tx.after_commit([stand_in] { stand_in->adopt_edges(); });
    ++tx.stats().nodes_rewritten;
    ++tx.stats().gemms_packed;
  }

 private:
  std::vector<int> output_;  // per node: the token operand's next_edge when it runs packed, else -1
};

}  // namespace

std::unique_ptr<Edit> make_packed_rows_edit() { return std::make_unique<PackedRowsEdit>(); }

}  // namespace collider::detail
