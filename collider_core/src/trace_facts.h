// Internal: what trace_plan has learned of a loss graph, handed to the plan's passes (passes/pass.h,
// the edits' analysis steps among them): both traces (graphs, sizes, every node's observation)
// and what the classification collected for the passes after it. Built in build_plan (trace.cpp).
#pragma once

#include "classify.h"
#include "graph.h"
#include "observe.h"
#include "routes.h"

#include <cstdint>
#include <set>
#include <vector>

namespace collider::detail {

// What the classification of every node collects for the steps after it.
struct Classified {
  std::vector<std::vector<std::vector<int64_t>>> values;  // trace-a values per kept field
  std::vector<RoutedCandidate> candidates;                 // fields taken as routed (routes.h)
  std::set<int> python_functions;                          // Python custom Functions with token fields
  std::set<int> sink_ops;  // cat, slice or max along T + c positions: attention sinks, if the field cut's
                           // analysis (edits/field_cut.cpp) agrees
};

// Trace a (the plan's sizes) and trace b, node by node.
struct TraceFacts {
  const Graph& ga;
  const Graph& gb;
  Sizes sa, sb;
  const std::vector<ObservedNode>& oa;
  const std::vector<ObservedNode>& ob;
  const Classified& classified;
};

}  // namespace collider::detail
