// Internal: locating attention cores (QK^T -> softmax -> PV) in a traced plan, so exact_query
// knows query rows from key columns, and what blocks exact_query where a core is not recognised.
// Used by trace_plan (trace.cpp). Tests: tests/test_core_plan.cpp, tests/test_collider_*.cpp.
#pragma once

#include "graph.h"
#include "plan_impl.h"

namespace collider::detail {

// Marks the nodes of every attention core (NodeSpec::attention_core), gives their key-side token
// dimensions Role::kKey, adds the key-row edge inserts, counts the cores and sets
// plan.exact_query_blocker to what stops exact_query ("" when nothing does).
void find_attention_cores(const Graph& g, PlanData& plan);

}  // namespace collider::detail
