// trace_plan: finds, for every node of the loss graph, which fields carry token dimensions.
// The loss is built twice on dummy batches (B_a, T_a) and (B_b, T_b) of sizes no model uses;
// a dimension is a token dimension when it equals T (or B*T) in both traces, a batch dimension
// when it is B times the same constant in both. Attention cores (QK^T -> softmax -> PV) are
// located structurally so exact_query knows query rows from key columns. The pieces: observe.h
// (a node's fields in one trace), classify.h (token dimensions from two traces),
// attention_cores.h, passthrough.h (declared non-ATen nodes).
// Tests: tests/test_core_plan.cpp, tests/test_collider_*.cpp.
#include <collider/collider.h>

#include "classify.h"
#include "edits/edit.h"
#include "graph.h"
#include "head_node.h"
#include "node_fields.h"
#include "node_traits.h"
#include "observe.h"
#include "passthrough.h"
#include "plan_impl.h"
#include "routes.h"
#include "row_rules.h"
#include "slices.h"
#include "sdpa.h"
#include "token_rows.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdlib>
#include <deque>
#include <optional>
#include <set>
#include <vector>

namespace collider {
namespace detail {

namespace {

// COLLIDER_DEBUG_PLAN=1: refusals also list the node's saved fields.
bool debug_plan() {
  const char* v = std::getenv("COLLIDER_DEBUG_PLAN");
  return v && std::string(v) == "1";
}

// A node without a field handler (a custom Function, a torch.compile graph) whose gradients go into
// token-shaped inputs must take a token-shaped gradient itself (a passthrough maps rows one to
// one): one that makes them from a gradient without token dimensions (a compiled loss, a custom
// reduction) would hand full-length rows to nodes whose rows were cut.
void refuse_token_gradients_born_opaque(const Graph& g, const PlanData& plan) {
  for (size_t i = 0; i < plan.nodes.size(); ++i) {
    const NodeSpec& ns = plan.nodes[i];
    if (find_node_fields(*g.nodes[i]) || traits_of(ns.type).leaf) continue;
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
      if (traits_of(ns.type).compiled_graph) {
        throw Error(fmt::format(
            "collider cannot filter through node {} (#{}): a torch.compile (AOTAutograd) graph whose backward makes "
            "full-length token gradients. Build the loss (and the model) without torch.compile for the filtered step",
            ns.type, i));
      }
      throw Error(fmt::format(
          "collider cannot filter through node {} (#{}): not an ATen op, and it makes token-shaped gradients (for "
          "{} #{}) from a gradient without token dimensions, at full length. Write it with torch operations",
          ns.type, i, c.type, g.index.at(e.function.get())));
    }
  }
}

// Whether node a (b: the same node in the other trace) is a cat, slice or maximum along a dimension
// of T + c positions (c <= kMaxTokenPlus): what attention sinks look like (GPT-OSS: scores [.., T]
// and sinks [.., 1] concatenated, the row maximum subtracted, the sinks sliced off after the
// softmax). Such a node is taken provisionally; the field cut's check_sinks (edits/field_cut.cpp)
// keeps it only inside an attention core.
bool along_token_plus_dim(const ObservedNode& a, const ObservedNode& b, Sizes sa, Sizes sb) {
  const SinkRole sink = traits_of(a.type).sink;
  if (sink != SinkRole::kCat && sink != SinkRole::kSlice && sink != SinkRole::kMax) return false;
  if (!a.dim || !b.dim || a.fields.size() != b.fields.size()) return false;
  for (size_t k = 0; k < a.fields.size(); ++k) {
    const Observed& x = a.fields[k];
    const Observed& y = b.fields[k];
    if (x.kind == FieldKind::kSaved || x.scalar || x.values.size() != y.values.size() || x.values.empty()) continue;
    const int64_t rank = static_cast<int64_t>(x.values.size());
    const int64_t d = *a.dim < 0 ? *a.dim + rank : *a.dim;
    if (d < 0 || d >= rank) continue;
    const int64_t c = x.values[d] - sa.T;
    if (c >= 1 && c <= kMaxTokenPlus && y.values[d] - sb.T == c) return true;
  }
  return false;
}

// What differs between the two traces' observations of one node: its type, else its fields (a cat of
// 3 tensors in one trace and 4 in the other), each as "count name" in order of first appearance.
std::string trace_difference(const ObservedNode& a, const ObservedNode& b, Sizes sa, Sizes sb) {
  if (a.type != b.type) return fmt::format("is {} in one trace and {} in the other", a.type, b.type);
  auto fields = [](const ObservedNode& o) {
    std::vector<std::pair<std::string, int>> counts;
    for (const auto& f : o.fields) {
      if (counts.empty() || counts.back().first != f.name) counts.emplace_back(f.name, 0);
      ++counts.back().second;
    }
    std::string out;
    for (const auto& [name, count] : counts) out += fmt::format("{}{} {}", out.empty() ? "" : ", ", count, name);
    return out;
  };
  return fmt::format("({}) has the fields {} for (B={}, T={}) but {} for (B={}, T={})", a.type, fields(a), sa.B, sa.T,
                     fields(b), sb.B, sb.T);
}

enum class FusedSequence { kTokens, kOther, kMixed };

// Whether a fused attention node (a, b: its two observations) attends over the tokens: its query and
// key ([B, H, L, E]) both have L = T in both traces. kOther: no field of it has token positions;
// kMixed: some have, but not as a self-attention over the tokens (cross-attention).
FusedSequence fused_attention_sequence(const ObservedNode& a, const ObservedNode& b, Sizes sa, Sizes sb) {
  bool tokens = false, query = false, key = false;
  for (size_t k = 0; k < a.fields.size(); ++k) {
    const Observed& x = a.fields[k];
    const Observed& y = b.fields[k];
    if (!x.defined || !y.defined || x.kind == FieldKind::kStrides || x.scalar) continue;
    const bool positions = x.values.size() >= 2 && y.values.size() == x.values.size() &&
                           x.values[x.values.size() - 2] == sa.T && y.values[y.values.size() - 2] == sb.T;
    query = query || (x.name == "query_" && positions);
    key = key || (x.name == "key_" && positions);
    ShapeSpec spec;
    std::string why;
    tokens = tokens || !classify(x, y, sa, sb, spec, why) || spec.has_token();
  }
  if (query && key) return FusedSequence::kTokens;
  return tokens ? FusedSequence::kMixed : FusedSequence::kOther;
}

// The two traces observed node by node (observe.h), refused where they differ other than in
// sizes: a graph that depends on the batch or sequence size cannot be planned (a mixture of
// experts whose expert got no token in one trace: AmbiguousRoute, which trace_plan retries).
void observe_traces(const Graph& ga, const Graph& gb, Sizes sa, Sizes sb, std::vector<ObservedNode>& oa,
                    std::vector<ObservedNode>& ob) {
  const size_t n = ga.nodes.size();
  // transformers' eager experts skip an expert that receives no token: a mixture-of-experts graph
  // (scatters back into token rows) differs then, and other random tokens may use them all.
  auto scatters = [](const Graph& g) {
    for (const auto& node : g.nodes)
      if (traits_of(node->name()).route == RouteRole::kScatter) return true;
    return false;
  };
  if (gb.nodes.size() != n) {
    if (scatters(ga) || scatters(gb)) {
      throw AmbiguousRoute(fmt::format(
          "trace_plan: the loss graph has {} nodes for (B={}, T={}) but {} for (B={}, T={}): an expert of a "
          "mixture-of-experts layer received no token in one trace",
          n, sa.B, sa.T, gb.nodes.size(), sb.B, sb.T));
    }
    throw Error(
        fmt::format("trace_plan: the loss graph has {} nodes for (B={}, T={}) but {} for (B={}, T={}); "
                    "the model's graph must not depend on the batch or sequence size",
                    n, sa.B, sa.T, gb.nodes.size(), sb.B, sb.T));
  }
  oa.assign(n, {});
  ob.assign(n, {});
  for (size_t i = 0; i < n; ++i) {
    oa[i] = observe(ga.nodes[i]);
    ob[i] = observe(gb.nodes[i]);
    if (oa[i].type != ob[i].type || oa[i].fields.size() != ob[i].fields.size()) {
      const std::string differs = trace_difference(oa[i], ob[i], sa, sb);
      if (scatters(ga)) {
        throw AmbiguousRoute(fmt::format(
            "trace_plan: node #{} {}: an expert of a mixture-of-experts layer received no token in one trace", i,
            differs));
      }
      throw Error(fmt::format(
          "trace_plan: node #{} {}; the graph must not depend on the batch or sequence size", i, differs));
    }
  }
}

// Node i's fields classified (classify.h) into plan.nodes[i]: its token-shaped fields kept, the
// fused attention marked (the fused attention edit replaces it whole), and every node whose
// token fields no edit can cut refused with what to do.
void classify_node(const Graph& ga, size_t i, const std::vector<ObservedNode>& oa,
                   const std::vector<ObservedNode>& ob, Sizes sa, Sizes sb, PlanData& plan, Classified& out) {
  NodeSpec& ns = plan.nodes[i];
  ns.type = oa[i].type;
  if (along_token_plus_dim(oa[i], ob[i], sa, sb)) out.sink_ops.insert(static_cast<int>(i));
  if (traits_of(ns.type).fused_attention != FusedAttention::kNone) {
    // Replaced whole at filter time (sdpa.h), which cuts its query rows and key columns as token
    // positions: only where its query positions are the tokens. One over positions of their own
    // (a vision tower's image patches, a fixed memory) is an ordinary node with nothing
    // token-shaped, left as it is.
    switch (fused_attention_sequence(oa[i], ob[i], sa, sb)) {
      case FusedSequence::kTokens: ns.fused_attention = true; return;
      case FusedSequence::kOther: return;
      case FusedSequence::kMixed:
        throw Error(fmt::format(
            "collider cannot rewrite node {} (#{}): a fused attention whose query and key positions are not both "
            "the tokens (a cross-attention); use attn_implementation=\"eager\" for that module, or train it "
            "without token filtering",
            ns.type, i));
    }
  }
  if (traits_of(ns.type).reentrant_checkpoint) {
    throw Error(
        fmt::format("collider cannot filter through node {} (#{}): {}", ns.type, i, reentrant_checkpoint_advice()));
  }
  for (size_t k = 0; k < oa[i].fields.size(); ++k) {
    const Observed& a = oa[i].fields[k];
    const Observed& b = ob[i].fields[k];
    if (!a.defined || !b.defined) continue;
    if (a.kind == FieldKind::kStrides) continue;  // recomputed from the sibling sizes when those are cut
    ShapeSpec spec;
    std::string why;
    // A size that follows neither B nor T may be a mixture-of-experts route (routes.h): taken as
    // routed here, refused by assign_routes unless a route claims it.
    if (!classify(a, b, sa, sb, spec, why) && classify(a, b, sa, sb, spec, why, /*allow_routed=*/true)) {
      out.candidates.push_back(RoutedCandidate{static_cast<int>(i), a.name, why});
    } else if (!why.empty()) {
      // Its saved fields, which help whoever extends the rewriter, only under COLLIDER_DEBUG_PLAN=1:
      // the message itself stays short enough to read (node, reason, what to do).
      // (A size that follows neither B nor T reaches here only with a rank that differs between
      // the traces; a routed one is assign_routes' to refuse, with its advice.)
      throw Error(fmt::format(
          "collider cannot rewrite node {} (#{}): field {} {}.{}", ns.type, i, a.name, why,
          debug_plan() ? fmt::format(" Saved fields: {}", oa[i].described.empty() ? "(none)" : oa[i].described)
                       : std::string()));
    }
    if (!spec.has_token()) continue;
    if (spec.has_routed() && spec.dims.size() != 1) {  // one routed dimension, nothing else that scales
      throw Error(fmt::format("collider cannot rewrite node {} (#{}): field {} {}", ns.type, i, a.name, why));
    }
    if (!oa[i].generated && traits_of(ns.type).compiled_graph) {
      throw Error(
          fmt::format("collider cannot rewrite node {} (#{}): it is a torch.compile (AOTAutograd) graph, "
                      "whose saved activations live inside compiled code the rewriter cannot cut. Trace "
                      "and filter the model and loss without torch.compile.",
                      ns.type, i));
    }
    // A Python custom Function (its saved tensors visible): taken if its backward maps rows one to
    // one, which check_python_functions (edits/field_cut.cpp) runs it to see once the fields are classified. One
    // declared passthrough is not run (DDP's and FSDP2's queue work for the end of the backward).
    if (!oa[i].generated && custom_saved(*ga.nodes[i]) && !is_passthrough(ns.type) &&
        (a.kind == FieldKind::kSaved || a.kind == FieldKind::kInputMeta)) {
      out.python_functions.insert(static_cast<int>(i));
      ns.fields.push_back(FieldSpec{a.name, a.kind, a.item, spec});
      out.values[i].push_back(a.values);
      continue;
    }
    if (!oa[i].generated && a.kind == FieldKind::kSaved) {
      throw Error(fmt::format(
          "collider cannot filter through node {} (#{}): declared passthrough, but it saves a token-shaped tensor "
          "([{}]), which its backward would read at full length; registering it does not make that safe. Write "
          "the op with torch operations",
          ns.type, i, fmt::join(a.values, ", ")));
    }
    if (a.scalar) {
      if (a.name.find("numel") != std::string::npos) continue;  // a divisor fixed by the forward (mean)
      if (out.sink_ops.count(static_cast<int>(i)) && traits_of(ns.type).sink == SinkRole::kSlice && a.name == "end") {
        spec.dims[0].role = Role::kKey;  // the sinks sliced off the key columns: [..., :T] (check_sinks)
        ns.fields.push_back(FieldSpec{a.name, a.kind, a.item, spec});
        out.values[i].push_back(a.values);
        continue;
      }
      throw Error(fmt::format(
          "collider cannot rewrite node {} (#{}): scalar field {} equals the sequence length; "
          "the op indexes along the token dimension{}",
          ns.type, i, a.name, debug_plan() ? fmt::format(". Saved fields: {}", oa[i].described) : std::string()));
    }
    if (a.name.rfind("geometry:", 0) == 0) {
      throw Error(
          fmt::format("collider cannot rewrite node {} (#{}): field {} (a TensorGeometry) has token "
                      "dimensions",
                      ns.type, i, a.name.substr(9)));
    }
    if (traits_of(ns.type).copy_slices && a.kind == FieldKind::kInputMeta) {
      if (!oa[i].described.empty()) {  // slices.h: the cases it cuts
        throw Error(fmt::format(
            "collider cannot rewrite node {} (#{}): an in-place write into a slice of a token-shaped tensor "
            "that collider does not cut ({}). Build the tensor with torch.cat",
            ns.type, i, oa[i].described));
      }
      ns.fields.push_back(FieldSpec{a.name, a.kind, a.item, spec});
      out.values[i].push_back(a.values);
      continue;
    }
    if (!oa[i].generated && a.kind == FieldKind::kInputMeta && !is_passthrough(ns.type) && !traits_of(ns.type).leaf) {
      // A node of C++ code (a Python custom Function is checked by running it, above): the contract
      // is the user's to check.
      throw Error(fmt::format(
          "collider cannot rewrite node {} (#{}): not an ATen op, and its input has token dimensions. Only if "
          "it saves nothing token-shaped and its backward maps gradient rows one to one, "
          "collider.register_passthrough_node(\"{}\") declares it safe",
          ns.type, i, ns.type));
    }
    if (traits_of(ns.type).mixes_tokens && along_token_dim(oa[i], a, spec) &&
        !is_cat_onto_empty(oa[i], ob[i], sa, sb) && !out.sink_ops.count(static_cast<int>(i))) {
      throw Error(
          fmt::format("collider cannot rewrite node {} (#{}): it mixes or indexes positions along a "
                      "token dimension (field {}); filtering rows would change its result{}",
                      ns.type, i, a.name, traits_of(ns.type).mixing_hint));
    }
    ns.fields.push_back(FieldSpec{a.name, a.kind, a.item, spec});
    out.values[i].push_back(a.values);
  }
}

}  // namespace

// The plan: both traces observed, every node classified, then the whole-graph steps in order:
// first the check that every token gradient is born in a node an edit can cut, then each edit's
// analysis step in the order of the analysis table (edits/table.cpp), each writing the part of the
// plan its edit reads, then which token-sized rows are the tokens (token_rows.h: a second sequence of the
// same length, an encoder's source, is not), last the check that each cut node acts row by row
// (row_rules.h).
PlanData build_plan(const Graph& ga, const Graph& gb, Sizes sa, Sizes sb) {
  PlanData plan;
  plan.batch_a = sa.B;
  plan.seq_a = sa.T;
  plan.batch_b = sb.B;
  plan.seq_b = sb.T;
  std::vector<ObservedNode> oa, ob;
  observe_traces(ga, gb, sa, sb, oa, ob);
  const size_t n = ga.nodes.size();
  plan.nodes.resize(n);
  plan.children.resize(n);
  for (size_t i = 0; i < n; ++i)
    for (const auto& e : ga.nodes[i]->next_edges())
      plan.children[i].push_back(e.function ? ga.index.at(e.function.get()) : -1);
  Classified c;
  c.values.resize(n);
  for (size_t i = 0; i < n; ++i) classify_node(ga, i, oa, ob, sa, sb, plan, c);
  refuse_token_gradients_born_opaque(ga, plan);
  const TraceFacts facts{ga, gb, sa, sb, oa, ob, c};
  for (const AnalysisStep step : analysis_table()) step(facts, plan);
  separate_sequences(ga, plan);
  check_row_rules(ga, plan, oa);
  return plan;
}

}  // namespace detail

static Plan trace_plan_impl(const LossOnBatchFn& loss_on_random_batch, const TraceOptions& opts) {
  if (!loss_on_random_batch) throw Error("trace_plan: no loss function given");
  auto build = [&](int64_t B, int64_t T) {
    torch::Tensor loss = loss_on_random_batch(B, T);
    if (!loss.defined() || !loss.requires_grad() || !loss.grad_fn()) {
      throw Error(
          "trace_plan: the loss function must return a loss that requires grad (build it from the "
          "model's parameters, outside torch::NoGradGuard)");
    }
    if (loss.numel() != 1) throw Error("trace_plan: the loss must be a scalar");
    return loss;
  };
  if (opts.batch_a < 2 || opts.batch_b < 2 || opts.batch_a == opts.batch_b || opts.seq_a == opts.seq_b) {
    throw Error("trace_plan: the two trace batches must differ and be >= 2, and the two sequence lengths differ");
  }
  // A mixture-of-experts route whose sizes look like the batch's own (detail::AmbiguousRoute) is
  // traced again: the loss function is called on new random tokens each time.
  auto plan_for = [&](int64_t Ba, int64_t Bb) {
    for (int attempt = 1;; ++attempt) {
      torch::Tensor la = build(Ba, opts.seq_a);
      torch::Tensor lb = build(Bb, opts.seq_b);
      detail::Graph ga = detail::collect_graph(detail::loss_root(la.grad_fn()));
      detail::Graph gb = detail::collect_graph(detail::loss_root(lb.grad_fn()));
      try {
        return detail::build_plan(ga, gb, {Ba, opts.seq_a}, {Bb, opts.seq_b});
      } catch (const detail::AmbiguousRoute& e) {
        if (attempt == 8) {
          throw UntraceableRoutes(fmt::format(
              "{} (8 tries on new random tokens); trace more tokens (TraceOptions), or a trained router if this "
              "one sends every token to a few experts",
              e.what()));
        }
      }
    }
  };
  Plan plan;
  plan.impl().variants.push_back(plan_for(opts.batch_a, opts.batch_b));
  plan.impl().variants.push_back(plan_for(1, 1));
  return plan;
}

// Only collider::Error leaves: a failure of the loss function or of a tensor op while tracing
// is reported as one (first line of the message; c10::Error appends a C++ backtrace).
Plan trace_plan(const LossOnBatchFn& loss_on_random_batch, const TraceOptions& opts) {
  try {
    return trace_plan_impl(loss_on_random_batch, opts);
  } catch (const Error&) { throw; } catch (const std::exception& e) {
    std::string what = e.what();
    throw Error("trace_plan: building or tracing the loss failed: " + what.substr(0, what.find('\n')));
  }
}

}  // namespace collider
