// The ordered table of the plan's passes, and the driver that runs it (pass.h). The order is the
// order of precedence: per node, the node passes before its fields and, per field, the checks in
// the order a refusal must win (a field that is not classified is refused before anything asks
// what kind of node holds it; a torch.compile graph before the checks of custom Functions); the
// whole-graph passes last, each after the passes whose plan it reads: the check that every token
// gradient is born where an edit can cut it, the edits' analysis steps (in their edits' files:
// the flattened rows' order first, which the routes and the broadcast layouts read, the attention
// cores before the sinks that must lie in one), which token-sized rows are the tokens
// (token_rows.h), and last the check that each cut node acts row by row (row_rules.h).
#include "pass.h"

#include "../edits/edit.h"
#include "../row_rules.h"
#include "../token_rows.h"

#include <cstdlib>

namespace collider::detail {

namespace {

void separate_sequences_pass(const TraceFacts& t, PlanData& plan) { separate_sequences(t.ga, plan); }
void check_row_rules_pass(const TraceFacts& t, PlanData& plan) { check_row_rules(t.ga, plan, t.oa); }

}  // namespace

bool debug_plan() {
  const char* v = std::getenv("COLLIDER_DEBUG_PLAN");
  return v && std::string(v) == "1";
}

const std::vector<PlanPass>& plan_passes() {
  static const std::vector<PlanPass> table = {
      // per node, before its fields
      {"sinks", record_sinks},                    // cat, slice, max along T + c
      {"fused attention", mark_fused_attention},  // replaced whole, or left, or refused
      {"reentrant checkpoint", refuse_reentrant_checkpoint},
      // per field
      {"field dimensions", nullptr, classify_field},  // token, batch, routed; the rest dropped
      {"routed sizes", nullptr, refuse_routed_with_tokens},
      {"compiled graphs", nullptr, refuse_compiled_graph},
      {"python functions", nullptr, record_python_function},  // kept, run by the field cut's step
      {"passthrough saves", nullptr, refuse_passthrough_saves},
      {"scalar fields", nullptr, check_scalar_field},
      {"tensor geometry", nullptr, refuse_tensor_geometry},
      {"copy slices", nullptr, check_copy_slices},
      {"non-ATen nodes", nullptr, refuse_non_aten_input},
      {"token mixing", nullptr, run_token_mixing_whole},  // run whole
      // over the whole graph
      {"opaque gradients", nullptr, nullptr, refuse_token_gradients_born_opaque},
      {"flattened row order", nullptr, nullptr, field_cut_flat_order},         // field cut
      {"routes", nullptr, nullptr, route_scatters_routes},                     // route scatters
      {"broadcast layouts", nullptr, nullptr, field_cut_broadcast},            // field cut
      {"python function rows", nullptr, nullptr, field_cut_python_functions},  // field cut
      {"attention cores", nullptr, nullptr, attention_rows_cores},  // attention rows (key rows, sinks read it)
      {"sinks check", nullptr, nullptr, field_cut_sinks},           // field cut
      {"sequences", nullptr, nullptr, separate_sequences_pass},     // token_rows.h
      {"row rules", nullptr, nullptr, check_row_rules_pass},        // row_rules.h
  };
  return table;
}

void run_plan_passes(const TraceFacts& trace, Classified& out, PlanData& plan) {
  const std::vector<PlanPass>& table = plan_passes();
  for (size_t i = 0; i < plan.nodes.size(); ++i) {
    NodeSpec& ns = plan.nodes[i];
    ns.type = trace.oa[i].type;
    NodeFacts node{trace, i, trace.oa[i], trace.ob[i], traits_of(ns.type), ns, out};
    bool done = false;
    for (const PlanPass& p : table) {
      if (p.node && p.node(node) == NodeVerdict::kDone) {
        done = true;
        break;
      }
    }
    if (done) continue;
    for (size_t k = 0; k < node.a.fields.size(); ++k) {
      FieldFacts field{node.a.fields[k], node.b.fields[k], {}, {}};
      FieldVerdict verdict = FieldVerdict::kNext;
      for (const PlanPass& p : table) {
        if (!p.field) continue;
        verdict = p.field(node, field);
        if (verdict != FieldVerdict::kNext) break;
      }
      if (verdict == FieldVerdict::kSkip) continue;
      ns.fields.push_back(FieldSpec{field.a.name, field.a.kind, field.a.item, field.spec});
      out.values[i].push_back(field.a.values);
    }
    if (ns.run_whole) mark_run_whole(ns, &out.values[i]);
  }
  for (const PlanPass& p : table)
    if (p.graph) p.graph(trace, plan);
}

}  // namespace collider::detail
