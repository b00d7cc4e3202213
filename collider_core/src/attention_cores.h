// Internal: locating attention cores (QK^T -> softmax -> PV) in a traced plan, so exact_query
// knows query rows from key columns, and what blocks exact_query where a core is not recognised.
// Used by trace_plan (trace.cpp). Tests: tests/test_core_plan.cpp, tests/test_collider_*.cpp.
#pragma once

#include "graph.h"
#include "plan_impl.h"

#include <vector>

namespace collider::detail {

// The nodes of one attention core around the softmax node `softmax`: the QK^T and PV batched
// matmuls and the shape/scale nodes between them (down: softmax -> QK^T, up: softmax -> PV, in
// walking order). qk / pv are -1 when the softmax is not between two batched matmuls.
struct AttentionCoreNodes {
  int softmax = -1, qk = -1, pv = -1;
  std::vector<int> down, up;
};
AttentionCoreNodes locate_attention_core(const Graph& g, const PlanData& plan, int softmax);

// Marks the nodes of every attention core (NodeSpec::attention_core), gives their key-side token
// dimensions Role::kKey, adds the key-row edge inserts, counts the cores and sets
// plan.exact_query_blocker to what stops exact_query ("" when nothing does).
void find_attention_cores(const Graph& g, PlanData& plan);

}  // namespace collider::detail
