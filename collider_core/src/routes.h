// Internal: mixture-of-experts routes. A route is the tokens one expert of a mixture-of-experts
// layer received, written the way transformers' eager experts write it:
//   rows_RD = hidden_MD[idx_R]            (IndexBackward0: the gather; M = B*T token rows)
//   out_RD  = expert(rows_RD) * weight_R  (row-wise ops, the expert's GEMMs)
//   final_MD.index_add_(0, idx_R, out_RD) (IndexAddBackward0: the scatter back; names the route)
// R, the number of routed rows, depends on the data (DimKind::kRouted). A dropped token's rows are
// cut from every route it is in, so each expert's backward GEMMs shrink by the dropped tokens it
// received; the route's index is rewritten to the kept tokens' rows of the cut [B*N] layout.
// Trace time: assign_routes finds each scatter, walks its source side down to the gathers and
// gives every routed dimension there its route; a routed dimension no route claims is refused.
// Filter time: register_routes reads each route's index from its scatter node (TokenIndex::add_route).
// An expert that received no token of the step is skipped by transformers' eager experts, so its
// route is absent from the graph: plan_without_absent_routes derives the plan for that graph.
// Grouped experts (transformers' default, torch._grouped_mm) send one route per layer: the B*T*k
// token-expert pairs sorted by expert, named after the IndexBackward0 of the sort's inverse that
// puts them back in token order (routes.cpp, assign_sorted_route; TokenIndex::add_sorted_route).
// Tests: python/tests/test_moe.py.
#pragma once

#include "classify.h"
#include "graph.h"
#include "observe.h"

#include <collider/collider.h>
#include "collider/torch_compat.h"
#include "plan_impl.h"

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace collider::detail {

class TokenIndex;

// A field classify() took as routed (allow_routed), and what to say if no route claims it.
struct RoutedCandidate {
  int node = 0;
  std::string field;
  std::string why;
};

// A route whose sizes in the two traces could be read as the batch's own (an expert received as
// many tokens in both traces, or T of them), or an expert that received no token in one trace:
// trace_plan traces again on other random tokens.
struct AmbiguousRoute : Error {
  using Error::Error;
};

// Gives every routed dimension of the plan its route (DimSpec::route) and marks the index fields
// (kRoutedPositions); throws collider::Error where a routed field belongs to no route, or where an
// index op addresses token rows in a way a route does not describe, and AmbiguousRoute (above).
// Runs after resolve_flat_order.
void assign_routes(const Graph& g, const std::vector<ObservedNode>& oa, const std::vector<ObservedNode>& ob,
                   Sizes sa, Sizes sb, PlanData& plan, const std::vector<RoutedCandidate>& candidates);

// Reads every route's index from the graph into `ix`; throws collider::Error (graph untouched)
// where one cannot be read or does not address [B*T] rows. A route whose index is behind
// saved-tensor hooks is registered as hooked (below).
void register_routes(const Graph& g, const PlanData& plan, TokenIndex& ix, const char* who);

// Routes behind saved-tensor hooks (activation checkpointing, offloading). Their index exists only
// when the backward unpacks it, after filter_backward has written the rewrite, so such a route is
// not cut: it runs on all its rows, a dropped token's rows with a zero gradient, which gives each
// expert the gradient of its kept tokens alone (exact; its GEMMs keep their full size, and
// checkpointing its memory saving). The scatter is replaced by the node below; the gathers' index
// becomes, when unpacked, rows of the cut [B*N] token rows (a dropped token's row 0, which its zero
// gradient leaves as it is); the fields inside the route are left alone.
// The node in place of a hooked route's scatter (IndexAddBackward0 `scatter`): it takes the cut
// token rows' gradient ([B*N, ..], input shape cut_input_sizes), passes it on along the scatter's
// first edge (the rows added into, as IndexAddBackward0 does) and gives the route, along the
// second, a kept token's cut row and zeros for a dropped one, by the index it unpacks through the
// scatter's hooks when the backward reaches it.
class HookedScatterNode final : public torch::autograd::Node {
 public:
  HookedScatterNode(NodePtr scatter, std::shared_ptr<TokenIndex> ix);
  std::string name() const override { return "collider::HookedRouteScatter"; }
  // The scatter's edges, taken once every edge write of the rewrite is done (the scatter before it
  // in the chain may have been replaced too).
  void adopt_edges();
  void release_variables() override;
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override;

 private:
  NodePtr scatter_;
  std::shared_ptr<TokenIndex> ix_;
};

NodePtrOf<HookedScatterNode> make_hooked_scatter(const NodePtr& scatter,
                                                       std::shared_ptr<TokenIndex> ix,
                                                       const std::vector<int64_t>& cut_input_sizes);

// The plan for a graph in which some routes of `plan` are absent (experts that received no token of
// this step). The graph's nodes are matched to the plan's by walking both from the loss along the
// plan's edges (PlanData::children); where the plan has a route's scatter that the graph lacks, the
// walk passes over it along the chain of scatters (its edge 0, the tensor the rows are added into).
// The routes of one layer line up in order, each of the graph's routes taking the specs of the
// plan's route it meets: the experts of a layer are the same ops on rows of the same width, and
// the rewrite checks every routed size against the route's own index. Returns the plan in the
// graph's node order, or nullopt where the graph differs from the plan in anything else (or the plan
// has no edges). types: node_types(g).
std::optional<PlanData> plan_without_absent_routes(const Graph& g, const std::vector<const std::string*>& types,
                                                   const PlanData& plan);

}  // namespace collider::detail
