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
// Tests: python/tests/test_moe.py.
#pragma once

#include "classify.h"
#include "graph.h"
#include "observe.h"

#include <collider/collider.h>
#include "plan_impl.h"

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
// where one cannot be read (saved behind saved-tensor hooks) or does not address [B*T] rows.
void register_routes(const Graph& g, const PlanData& plan, TokenIndex& ix, const char* who);

// The plan for a graph in which some routes of `plan` are absent (experts that received no token of
// this step). The graph's nodes are matched to the plan's by walking both from the loss along the
// plan's edges (PlanData::children); where the plan has a route's scatter that the graph lacks, the
// walk passes over it along the chain of scatters (its edge 0, the tensor the rows are added into).
// The routes of one layer line up in order, each of the graph's routes taking the specs of the
// plan's route it meets: the experts of a layer are the same ops on rows of the same width, and
// the rewrite checks every routed size against the route's own index. Returns the plan in the
// graph's node order, or nullopt and `why` where the graph differs from the plan in anything else.
std::optional<PlanData> plan_without_absent_routes(const Graph& g, const PlanData& plan, std::string& why);

}  // namespace collider::detail
