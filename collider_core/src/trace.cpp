// trace_plan: finds, for every node of the loss graph, which fields carry token dimensions.
// The loss is built twice on dummy batches (B_a, T_a) and (B_b, T_b) of sizes no model uses;
// a dimension is a token dimension when it equals T (or B*T) in both traces, a batch dimension
// when it is B times the same constant in both. build_plan observes both traces (observe.h) and
// runs the plan's passes over them in the order of their table (passes/pass.h, passes/table.cpp):
// each field classified (classify.h), every node an edit cannot cut refused with what to do, then
// the whole-graph passes (the routes, the attention cores, the sinks, the sequences, the row rules).
// Tests: tests/test_core_plan.cpp, tests/test_collider_*.cpp.
#include <collider/collider.h>

#include "classify.h"
#include "graph.h"
#include "node_traits.h"
#include "observe.h"
#include "passes/pass.h"
#include "plan_impl.h"
#include "routes.h"
#include "trace_facts.h"

#include <fmt/format.h>

#include <vector>

namespace collider {
namespace detail {

namespace {

// What to do about a graph that changes with the trace sizes (appended to those refusals).
constexpr const char* kFollowsTheLength =
    "; a graph that follows the sequence length alone (a Python loop over chunks) is traced at two lengths "
    "that give one graph, the step's T and T - 1 or T + 1 (TraceOptions; collider.hf.trace_plan(model, "
    "seq_len=T)): a plan per length, merged into one with Plan::merge";


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
                    "the model's graph must not depend on the batch or sequence size{}",
                    n, sa.B, sa.T, gb.nodes.size(), sb.B, sb.T, kFollowsTheLength));
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
      throw Error(fmt::format("trace_plan: node #{} {}; the graph must not depend on the batch or sequence size{}", i,
                              differs, kFollowsTheLength));
    }
  }
}

}  // namespace

// The plan: both traces observed, then the plan's passes in the order of their table
// (passes/table.cpp): per node and per field, the checks and records of what each field's token
// dimensions are; then the whole-graph passes, the edits' analysis steps among them.
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
  const TraceFacts facts{ga, gb, sa, sb, oa, ob, c};
  run_plan_passes(facts, c, plan);
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
