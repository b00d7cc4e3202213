// The check that the loss gives dropped positions no gradient (see loss_checks.h).
// Legend: B batch, T sequence.
#include "loss_checks.h"

#include <collider/collider.h>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/generated/Functions.h>
#include <torch/csrc/autograd/variable.h>

#include <fmt/format.h>

#include <vector>

namespace collider::detail {
namespace {

namespace gen = torch::autograd::generated;
using torch::autograd::Node;

// A token-only tensor ([B, T], [T, B], [B*T] or [T*B], one value per position) laid out as [B, T];
// undefined for any other layout.
torch::Tensor as_BT(const torch::Tensor& t, const ShapeSpec& s, int64_t B, int64_t T) {
  if (!t.defined() || t.numel() != B * T || s.pad_rank != 0) return {};
  if (s.rank == 1 && s.dims.size() == 1 && s.dims[0].mult == 1) {
    if (s.dims[0].kind == DimKind::kFlatToken || s.dims[0].kind == DimKind::kToken) return t.view({B, T});
    if (s.dims[0].kind == DimKind::kFlatSeqFirst) return t.view({T, B}).t();
    return {};
  }
  if (s.rank == 2) {
    int32_t token = -1, batch = -1;
    for (const auto& d : s.dims) {
      if (d.kind == DimKind::kToken) token = d.dim;
      if (d.kind == DimKind::kBatch && d.mult == 1) batch = d.dim;
    }
    if (token < 0) return {};
    if (batch < 0) return B == 1 ? t.reshape({1, T}) : torch::Tensor();  // [1, T] of a one-row batch
    return token == 1 ? t : t.t();
  }
  return {};
}

// Every dimension of the node's input `item` is a token or batch dimension, or has size 1.
const FieldSpec* token_only_input(const Node& node, const NodeSpec& spec, uint32_t item) {
  const FieldSpec* f = spec.find(FieldKind::kInputMeta, static_cast<int32_t>(item));
  if (!f || !f->shape.has_token() || item >= node.num_inputs()) return nullptr;
  const auto& meta = node.input_metadata(item);
  if (meta.is_nested_tensor() || meta.is_cpp_nested_tensor()) return nullptr;
  const auto shape = meta.shape_as_dim_vector();
  for (size_t d = 0; d < shape.size(); ++d) {
    bool listed = false;
    for (const auto& ds : f->shape.dims) listed = listed || ds.dim == static_cast<int32_t>(d);
    if (!listed && shape[d].expect_int() != 1) return nullptr;
  }
  return f;
}

}  // namespace

void check_loss_ignores_dropped(const torch::Tensor& loss, const Graph& g, const PlanData& plan,
                                const TokenIndex& ix, const char* who) {
  const int64_t B = ix.B(), T = ix.T();
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> counted;  // bool [B, T]: positions the loss counts
  std::vector<std::string> what;       // for the message, one per entry of `counted`

  // A cross-entropy reduced over positions: the positions with a target other than ignore_index.
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    auto* nll = dynamic_cast<gen::NllLossBackward0*>(g.nodes[i].get());
    if (!nll || nll->reduction == 0 || nll->target_.has_hooks()) continue;
    const FieldSpec* f = plan.nodes[i].find(FieldKind::kSaved, 0, "target_");
    auto raw = nll->target_.get_raw_data();
    if (!f || !raw || !raw->defined()) continue;
    torch::Tensor target = as_BT(*raw, f->shape, B, T);
    if (!target.defined()) continue;
    counted.push_back(target != nll->ignore_index.expect_int());
    what.push_back(fmt::format("its target is not ignore_index {}). Set the labels of dropped positions to {} "
                               "(collider.hf.drop_labels",
                               nll->ignore_index.expect_int(), nll->ignore_index.expect_int()));
  }

  // A per-position loss: the gradient reaching it through the loss's reduction. The loss side is
  // the part of the graph reached from the loss through nodes whose input has no token
  // dimension or only token dimensions (a scalar, a [B, T] of per-position values); the
  // gradient is taken where a token-only tensor leaves it (into the per-position losses' node,
  // whose input carries more than one value per position).
  auto input_kind = [&](const Node& node, int c, uint32_t item) {  // 0 no token dims, 1 token-only, 2 more
    const FieldSpec* f = plan.nodes[c].find(FieldKind::kInputMeta, static_cast<int32_t>(item));
    if (!f || !f->shape.has_token()) return 0;
    return token_only_input(node, plan.nodes[c], item) ? 1 : 2;
  };
  std::vector<char> loss_side(g.nodes.size(), 0);
  if (!g.nodes.empty()) loss_side[0] = g.nodes[0]->num_inputs() == 1 && input_kind(*g.nodes[0], 0, 0) < 2;
  torch::autograd::edge_list outputs;
  std::vector<const FieldSpec*> specs;
  for (size_t i = 0; i < g.nodes.size(); ++i) {  // breadth-first from the loss: parents come first
    if (!loss_side[i]) continue;
    const Node& node = *g.nodes[i];
    bool leaves = false;
    for (const auto& e : node.next_edges()) {
      if (!e.function) continue;
      const int c = g.index.at(e.function.get());
      if (e.function->num_inputs() == 1 && input_kind(*e.function, c, e.input_nr) < 2 && !plan.nodes[c].fused_attention) {
        loss_side[c] = 1;
      } else {
        leaves = true;
      }
    }
    if (!leaves || node.num_inputs() != 1 || input_kind(node, static_cast<int>(i), 0) != 1) continue;
    outputs.emplace_back(g.nodes[i], 0);
    specs.push_back(plan.nodes[i].find(FieldKind::kInputMeta, 0));
  }
  if (!outputs.empty()) {
    // Runs only the nodes between the loss and these edges (the reduction, the mask multiply), and
    // keeps the graph: the backward itself runs them again.
    auto grads = torch::autograd::Engine::get_default_engine().execute(
        {torch::autograd::impl::gradient_edge(loss)}, {torch::ones_like(loss)}, /*keep_graph=*/true,
        /*create_graph=*/false, /*accumulate_grad=*/false, outputs);
    for (size_t k = 0; k < grads.size(); ++k) {
      torch::Tensor grad = as_BT(grads[k].defined() ? grads[k] : torch::Tensor(), specs[k]->shape, B, T);
      if (!grad.defined()) continue;
      counted.push_back(grad != 0);
      what.push_back(fmt::format("the loss's gradient reaching {} is not zero there). Multiply the per-position "
                                 "loss by the keep mask (collider.hf.masked_mean",
                                 outputs[k].function->name()));
    }
  }
  if (counted.empty()) return;
  const torch::Tensor dropped = ~ix.keep_BT().to(counted[0].device());
  torch::Tensor bad = torch::stack(counted).logical_and_(dropped);  // [checks, B, T]
  auto flat = bad.flatten().nonzero();
  if (flat.numel() == 0) return;  // the one sync of the check
  const int64_t at = flat[0].item<int64_t>(), check = at / (B * T), b = at % (B * T) / T, t = at % T;
  throw Error(fmt::format(
      "{}: the loss counts positions the keep mask drops, which filtering would change (row {}, position {}: {}). "
      "The mask is on the hidden states' positions: one on label positions is shifted by one "
      "(keep[:, t] = keep_labels[:, t + 1])",
      who, b, t, what[check]));
}

}  // namespace collider::detail
