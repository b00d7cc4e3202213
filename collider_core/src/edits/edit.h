// Internal: one edit of the rewrite, and the ordered table of them (table.cpp). An edit is one
// kind of cut: it finds the nodes (or edges) it applies to in the graph and the plan, checks them,
// computes what it writes and records every write through the transaction (transaction.h); it
// writes nothing itself, so the rewrite stays all or nothing. A pass over the table:
//   1. before(): every edit in table order, over the whole graph; it may take nodes for itself
//      (a whole attention core replaced by one stand-in);
//   2. the node pass: each node not taken yet goes to the first edit in table order whose takes()
//      accepts it, and that edit's cut() rewrites it;
//   3. after(): every edit in table order, over the whole graph (nodes inserted on edges, edges
//      removed), with every node's own cut known.
// Before any of this, when the plan is built (trace.cpp: build_plan), an edit that needs more of the
// plan than each node's token fields has an analysis step: it reads both traces (trace_facts.h) and
// writes its part of the plan (the flattened rows' order, the routes, the attention cores), or
// refuses what it cannot cut. The steps are whole-graph passes of the plan, run in the order of its
// pass table (passes/table.cpp).
// To add an edit: a file here that opens with what it cuts and why, its make_ function below, and
// its line in table.cpp, at the place where it must win over the edits after it; if it needs an
// analysis step, that step in the same file, declared below, with its line in the plan's pass table.
#pragma once

#include "../graph.h"
#include "../node_fields.h"
#include "../node_traits.h"
#include "../trace_facts.h"
#include "../transaction.h"

#include <memory>
#include <vector>

namespace collider::detail {

class Edit {
 public:
  virtual ~Edit() = default;
  virtual const char* name() const = 0;
  // Whole-graph analysis before the node pass; taken[i] = 1 keeps node i from every later edit.
  virtual void before(const Graph&, Transaction&, std::vector<char>& /*taken*/) {}
  // The node pass: whether this edit cuts node i, and the cut.
  virtual bool takes(const Graph&, int /*i*/, const Transaction&) const { return false; }
  virtual void cut(const Graph&, int /*i*/, Transaction&) {}
  // Whole-graph edits after the node pass.
  virtual void after(const Graph&, Transaction&) {}
};

// The edits, one file each (the table, table.cpp, says in which order they run).
std::unique_ptr<Edit> make_run_whole_edit();        // nodes that cannot be cut row by row: run at full size
std::unique_ptr<Edit> make_attention_rows_edit();   // ragged masks: eager attention cores row by row
std::unique_ptr<Edit> make_fused_attention_edit();  // SDPA nodes: a filtered attention backward
std::unique_ptr<Edit> make_leaf_rows_edit();        // leaf tensors with token rows: the gradient uncut
std::unique_ptr<Edit> make_packed_rows_edit();      // ragged masks: token-row GEMMs on packed rows
std::unique_ptr<Edit> make_route_scatters_edit();   // hooked mixture-of-experts scatters
std::unique_ptr<Edit> make_head_rows_edit();        // the fused LM head: its gradient written to the cut rows
std::unique_ptr<Edit> make_field_cut_edit();        // every other node: its saved tensors and sizes cut
std::unique_ptr<Edit> make_detach_edit();           // edges whose gradient is zero by construction
std::unique_ptr<Edit> make_zero_padding_edit();     // ragged masks: padding rows zeroed where gradients are born
std::unique_ptr<Edit> make_key_rows_edit();         // exact_query: dK/dV cut to the kept rows

// The analysis steps, in the files of their edits (passes/table.cpp runs them as whole-graph passes).
void field_cut_flat_order(const TraceFacts&, PlanData&);         // [B*T] rows: batch- or sequence-major
void route_scatters_routes(const TraceFacts&, PlanData&);        // mixture-of-experts routes (routes.h)
void field_cut_broadcast(const TraceFacts&, PlanData&);          // token fields without a batch dimension
void field_cut_python_functions(const TraceFacts&, PlanData&);   // Python custom Functions: rows one to one
void attention_rows_cores(const TraceFacts&, PlanData&);         // QK^T -> softmax -> PV (key rows reads them)
void field_cut_sinks(const TraceFacts&, PlanData&);              // attention sinks' T + c key columns

// Runs the table on g: every write recorded in tx, none made (Transaction::commit makes them).
void run_edits(const Graph& g, Transaction& tx);

}  // namespace collider::detail
