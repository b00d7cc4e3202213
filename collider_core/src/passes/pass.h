// Internal: one pass of the plan, and the ordered table of them (table.cpp). build_plan (trace.cpp)
// observes both traces, then runs the table: a pass checks or records one thing about the loss
// graph, reading the node traits (node_traits.h) and both traces, and writes only the plan
// (PlanData) and what the classification collects for the passes after it (Classified,
// trace_facts.h), or refuses with what to do. A pass has up to three hooks, each run in table order:
//   1. node(): per node, before its fields; kDone ends the node (a fused attention replaced whole);
//   2. field(): per field of that node, in the order observe.h gives them; kSkip drops the field,
//      kKeep keeps it (as classified into FieldFacts::spec), kNext hands it to the next pass; a
//      field no pass keeps or drops is kept;
//   3. graph(): after every node, over the whole plan (the edits' analysis steps among them).
// The order is the order of precedence: when several passes would refuse a node, the first one in
// the table speaks. To add a pass: a file here that opens with what it checks or records and why,
// its function declared below, and its line in table.cpp at the place where it must win over the
// passes after it. Tests: tests/test_core_plan.cpp, python/tests/test_messages.py, test_unseen_ops.py.
#pragma once

#include "../graph.h"
#include "../node_traits.h"
#include "../plan_impl.h"
#include "../trace_facts.h"

#include <cstddef>
#include <string>
#include <vector>

namespace collider::detail {

// Node i of the two traces, as the node passes see it.
struct NodeFacts {
  const TraceFacts& trace;
  size_t i;
  const ObservedNode& a;  // its observation in trace a (the plan's sizes)
  const ObservedNode& b;  // and in trace b
  const NodeTraits traits;
  NodeSpec& spec;   // what the plan records of it
  Classified& out;  // what the passes after classification read
};

// One field of that node: its two observations and, once classified, its dimensions.
struct FieldFacts {
  const Observed& a;
  const Observed& b;
  ShapeSpec spec;
  std::string why;  // why it could not be classified
};

enum class NodeVerdict { kNext, kDone };
enum class FieldVerdict { kNext, kSkip, kKeep };

struct PlanPass {
  const char* name;
  NodeVerdict (*node)(NodeFacts&) = nullptr;
  FieldVerdict (*field)(NodeFacts&, FieldFacts&) = nullptr;
  void (*graph)(const TraceFacts&, PlanData&) = nullptr;
};

// The passes in the order build_plan runs them (table.cpp).
const std::vector<PlanPass>& plan_passes();
// Runs the table on the two observed traces into plan (its sizes, nodes and children already set).
void run_plan_passes(const TraceFacts& trace, Classified& out, PlanData& plan);

// COLLIDER_DEBUG_PLAN=1: refusals also list the node's saved fields.
bool debug_plan();

// The passes, one file each (the table says in which order they run).
NodeVerdict record_sinks(NodeFacts&);                                   // sinks.cpp
NodeVerdict mark_fused_attention(NodeFacts&);                           // fused_attention.cpp
NodeVerdict refuse_reentrant_checkpoint(NodeFacts&);                    // reentrant_checkpoint.cpp
FieldVerdict classify_field(NodeFacts&, FieldFacts&);                   // field_dims.cpp
FieldVerdict refuse_routed_with_tokens(NodeFacts&, FieldFacts&);        // routed_sizes.cpp
FieldVerdict refuse_compiled_graph(NodeFacts&, FieldFacts&);            // compiled_graphs.cpp
FieldVerdict record_python_function(NodeFacts&, FieldFacts&);           // python_functions.cpp
FieldVerdict refuse_passthrough_saves(NodeFacts&, FieldFacts&);         // passthrough_saves.cpp
FieldVerdict check_scalar_field(NodeFacts&, FieldFacts&);               // scalar_fields.cpp
FieldVerdict refuse_tensor_geometry(NodeFacts&, FieldFacts&);           // tensor_geometry.cpp
FieldVerdict check_copy_slices(NodeFacts&, FieldFacts&);                // copy_slices.cpp
FieldVerdict refuse_non_aten_input(NodeFacts&, FieldFacts&);            // non_aten_nodes.cpp
FieldVerdict run_token_mixing_whole(NodeFacts&, FieldFacts&);          // token_mixing.cpp
void refuse_token_gradients_born_opaque(const TraceFacts&, PlanData&);  // opaque_gradients.cpp

}  // namespace collider::detail
