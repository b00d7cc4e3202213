// Pass (whole graph): a node without a field handler (a custom Function, a torch.compile graph)
// whose gradients go into token-shaped inputs must take a token-shaped gradient itself (a
// passthrough maps rows one to one): one that makes them from a gradient without token dimensions
// (a fused linear cross-entropy, a custom reduction) would hand full-length rows to nodes whose
// rows were cut. It runs whole (NodeSpec::run_whole: its gradients cut to the kept rows as they
// leave it); a torch.compile graph is refused. First among the whole-graph passes: every later one
// assumes token gradients are born where an edit can cut them.
#include "pass.h"

#include "../head_node.h"
#include "../node_fields.h"

#include <collider/collider.h>

#include <fmt/format.h>

namespace collider::detail {

void refuse_token_gradients_born_opaque(const TraceFacts& t, PlanData& plan) {
  const Graph& g = t.ga;
  for (size_t i = 0; i < plan.nodes.size(); ++i) {
    const NodeSpec& ns = plan.nodes[i];
    const NodeTraits traits = traits_of(ns.type);
    if (find_node_fields(*g.nodes[i]) || traits.leaf) continue;
    // Collider's fused LM head: the head edit (edits/head_rows.cpp) has it write the kept rows'
    // gradient straight into the cut layout.
    if (dynamic_cast<const FusedHeadNode*>(g.nodes[i].get())) continue;
    bool token_input = false;
    for (const auto& f : ns.fields)
      token_input = token_input || (f.kind == FieldKind::kInputMeta && f.shape.has_token());
    if (token_input) continue;
    for (const auto& e : g.nodes[i]->next_edges()) {
      if (!e.function) continue;
      const NodeSpec& c = plan.nodes[g.index.at(e.function.get())];
      const FieldSpec* in = c.find(FieldKind::kInputMeta, static_cast<int32_t>(e.input_nr));
      if (!in || !in->shape.has_token()) continue;
      if (traits.compiled_graph) {
        throw Error(fmt::format(
            "collider cannot filter through node {} (#{}): a torch.compile (AOTAutograd) graph whose backward makes "
            "full-length token gradients. Build the loss (and the model) without torch.compile for the filtered step",
            ns.type, i));
      }
      mark_run_whole(plan.nodes[i]);
      break;
    }
  }
}

}  // namespace collider::detail
