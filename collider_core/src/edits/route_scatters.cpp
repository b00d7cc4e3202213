// The route-scatters edit: the scatter (IndexAddBackward0) of a mixture-of-experts route whose
// index is behind saved-tensor hooks (checkpointing, offloading; routes.h). That index exists only
// when the backward unpacks it, after the rewrite is written, so the route keeps all its rows and
// its scatter is replaced by a node that takes the cut token rows and gives the route all of its
// rows, a dropped token's zero.
#include "edit.h"

#include "../routes.h"

namespace collider::detail {
namespace {

class RouteScattersEdit final : public Edit {
 public:
  const char* name() const override { return "route scatters"; }
  bool takes(const Graph&, int i, const Transaction& tx) const override {
    const NodeSpec& spec = tx.plan().nodes[i];
    return !spec.fields.empty() && !tx.masked() && traits_of(spec.type).route == RouteRole::kScatter &&
           tx.index().hooked_route(static_cast<int32_t>(i));
  }
  void cut(const Graph& g, int i, Transaction& tx) override {
    const NodeSpec& spec = tx.plan().nodes[i];
    const FieldSpec* in = spec.find(FieldKind::kInputMeta, 0);
    const auto full = to_ints(g.nodes[i]->input_metadata(0).shape_as_dim_vector());
    const std::string bad = in ? tx.index().mismatch(full, in->shape) : "no token rows";
    if (!bad.empty()) {
      throw Error(
          fmt::format("filter_backward: the graph does not match the plan at node #{} {}: {}. Re-trace the "
                      "plan for this model (collider::trace_plan).",
                      i, spec.type, bad));
    }
    auto node =
        make_hooked_scatter(g.nodes[i], tx.shared_index(), tx.index().cut_sizes(full, in->shape, tx.cut_keys()));
    tx.replace_node(g, i, node);
    tx.after_commit([node] { node->adopt_edges(); });
    ++tx.stats().nodes_rewritten;
  }
};

}  // namespace

// The analysis step: every field the classification took as routed claimed by a route, each route's
// scatter found (routes.h), or the field refused.
void route_scatters_routes(const TraceFacts& t, PlanData& plan) {
  assign_routes(t.ga, t.oa, t.ob, t.sa, t.sb, plan, t.classified.candidates);
}

std::unique_ptr<Edit> make_route_scatters_edit() { return std::make_unique<RouteScattersEdit>(); }

}  // namespace collider::detail
