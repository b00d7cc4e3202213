// filter_backward / mask_backward: replay a Plan on the autograd graph of one step.
// filter_backward cuts every token-shaped saved tensor to the kept rows (one gather per distinct
// tensor), shrinks recorded sizes and expected input shapes, and for exact_query inserts a node
// on each key/value edge of an attention core that cuts dK/dV to the kept rows. After it, the
// whole backward runs on [B, N] tokens (DESIGN.md section 3, paper section 4).
// mask_backward computes the same gradients on full-size tensors (the oracle).
// This file is the driver: it matches the graph to the plan, runs the table of edits
// (edits/table.cpp, one file per kind of cut) into a transaction (transaction.h), checks the
// result against mask_backward on first use, and commits. All or nothing: the edits check every
// node against the plan and compute every cut tensor, size list and replacement node without
// touching the graph; only when all of it succeeded does commit write them in (assignments that
// cannot fail). After any error the graph is as the forward left it, and a plain backward gives
// the loss_only gradient.
#include <collider/collider.h>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/variable.h>

#include "edits/edit.h"
#include "graph.h"
#include "loss_checks.h"
#include "node_fields.h"
#include "node_traits.h"
#include "nvtx.h"
#include "passthrough.h"
#include "plan_impl.h"
#include "routes.h"
#include "sdpa.h"
#include "token_index.h"
#include "transaction.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <mutex>

namespace collider {
namespace detail {
namespace {

bool has_routes(const PlanData& plan) {
  for (const auto& ns : plan.nodes)
    for (const auto& f : ns.fields)
      if (f.shape.has_routed()) return true;
  return false;
}

// A graph of another size than the plan's, first differing at node i (type t; `cast`: a dtype cast
// there, as another torch.autocast makes): one short line.
std::string node_count_mismatch(const Graph& g, const PlanData& plan, const char* who, size_t i, const std::string& t,
                                bool cast) {
  return fmt::format(
      "{}: the graph does not match the plan: {} nodes, the plan {} (node #{} is {}, the plan expects {}): "
      "another model, loss{} (Re-trace with collider::trace_plan), or one that follows the sequence length "
      "(collider.hf.trace_plan(model, seq_len=T))",
      who, g.nodes.size(), plan.nodes.size(), i, t, plan.nodes[i].type, cast ? " or torch.autocast" : "");
}

// Why the graph is not the one `plan` was traced on (its first differing node), or empty.
std::string type_mismatch(const Graph& g, const std::vector<const std::string*>& types, const PlanData& plan,
                          const char* who) {
  const size_t n = std::min(g.nodes.size(), plan.nodes.size());
  for (size_t i = 0; i < n; ++i) {
    const std::string& t = *types[i];
    // The fused attention kernels are interchangeable: which one runs can depend on the mask, the
    // dtype or the device (CUDA's flash takes no mask, the memory-efficient one does).
    if (t != plan.nodes[i].type &&
        !(plan.nodes[i].fused_attention && traits_of(t).fused_attention != FusedAttention::kNone)) {
      if (traits_of(t).reentrant_checkpoint)
        return fmt::format("{}: node #{} is {}: {}", who, i, t, reentrant_checkpoint_advice());
      const bool cast = traits_of(t).cast || traits_of(plan.nodes[i].type).cast;  // where the trace had none
      if (g.nodes.size() != plan.nodes.size()) return node_count_mismatch(g, plan, who, i, t, cast);
      if (cast) {
        return fmt::format(
            "{}: node #{} is {} but the plan expects {}: the casts differ, as when the forward runs under "
            "another torch.autocast than the trace did. Trace the plan under the same autocast (Plan::merge keeps "
            "both).",
            who, i, t, plan.nodes[i].type);
      }
      return fmt::format(
          "{}: node #{} is {} but the plan expects {}: the graph does not match the plan "
          "(another model, or a changed forward). Re-trace with collider::trace_plan.",
          who, i, t, plan.nodes[i].type);
    }
  }
  if (g.nodes.size() != plan.nodes.size()) {
    return fmt::format(
        "{}: the loss graph has {} nodes but the plan has {}: it was traced for another model "
        "or loss. Re-trace with collider::trace_plan.",
        who, g.nodes.size(), plan.nodes.size());
  }
  return {};
}

// The loss's graph and the plan variant it matches: the first variant for this batch's kind (B = 1
// or not) whose node sequence is the graph's, else the first with mixture-of-experts routes from
// which the graph differs only by experts that received no token (derived for it, routes.h); else
// Error with the first variant's mismatch.
std::pair<Graph, std::shared_ptr<const PlanData>> checked_graph(const torch::Tensor& loss, const Plan& plan,
                                                                int64_t batch, const char* who, int64_t& variant) {
  if (!loss.defined() || !loss.grad_fn()) {
    throw Error(fmt::format("{}: the loss has no grad_fn; build it from the model outputs with grad enabled", who));
  }
  if (loss.numel() != 1) throw Error(fmt::format("{}: the loss must be a scalar", who));
  std::vector<const PlanData*> candidates;
  for (const auto& v : plan.impl().variants)
    if ((v.batch_a == 1) == (batch == 1) && !v.nodes.empty()) candidates.push_back(&v);
  if (candidates.empty()) throw Error(fmt::format("{}: empty plan; build one with collider::trace_plan", who));
  Graph g = collect_graph(loss_root(loss.grad_fn()), candidates.front()->nodes.size());
  NodeNames names;
  const std::vector<const std::string*> types = node_types(g, names);
  std::string first_why;
  const auto& variants = plan.impl().variants;
  for (const PlanData* c : candidates) {
    std::string why = type_mismatch(g, types, *c, who);
    variant = c - variants.data();
    if (why.empty()) return {std::move(g), std::shared_ptr<const PlanData>(std::shared_ptr<void>(), c)};
    if (first_why.empty()) first_why = std::move(why);
  }
  for (const PlanData* c : candidates) {
    if (!has_routes(*c)) continue;
    variant = c - variants.data();
    if (auto derived = plan_without_absent_routes(g, types, *c)) {
      return {std::move(g), std::make_shared<const PlanData>(std::move(*derived))};
    }
  }
  throw Error(first_why);  // the first variant's mismatch says what differs
}

// The [B, T] the loss was computed on, read from the first input shape the plan marks with a token
// dimension (and a batch dimension, unless the plan is the one-row plan); -1 where unknown.
std::pair<int64_t, int64_t> loss_tokens(const Graph& g, const PlanData& plan) {
  const bool one_row = plan.batch_a == 1;
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    for (const auto& f : plan.nodes[i].fields) {
      if (f.kind != FieldKind::kInputMeta || f.shape.pad_rank != 0) continue;
      const auto& meta = g.nodes[i]->input_metadata(f.item);
      if (meta.is_nested_tensor() || meta.is_cpp_nested_tensor()) continue;
      const auto shape = meta.shape_as_dim_vector();
      int64_t B = one_row ? 1 : -1, T = -1;
      for (const auto& d : f.shape.dims) {
        if (d.dim >= static_cast<int32_t>(shape.size())) continue;
        if (d.kind == DimKind::kToken) T = shape[d.dim].expect_int();
        if (d.kind == DimKind::kBatch && d.mult > 0) B = shape[d.dim].expect_int() / d.mult;
      }
      if (B > 0 && T > 0) return {B, T};
    }
  }
  return {-1, -1};
}

// Graphs already rewritten (by their loss's root node), so a second call is refused by name.
class RewrittenGraphs {
 public:
  bool contains(const NodePtr& root) {
    std::lock_guard<std::mutex> lock(mutex_);
    roots_.erase(std::remove_if(roots_.begin(), roots_.end(), [](const auto& w) { return w.expired(); }), roots_.end());
    for (const auto& w : roots_)
      if (w.lock() == root) return true;
    return false;
  }
  void add(const NodePtr& root) {
    std::lock_guard<std::mutex> lock(mutex_);
    roots_.emplace_back(root);
  }

 private:
  std::mutex mutex_;
  std::vector<WeakNodePtr> roots_;
};
RewrittenGraphs& rewritten_graphs() {
  static RewrittenGraphs r;
  return r;
}

// A Python custom Function must save nothing token-shaped beyond what the plan cuts (trace_plan
// ran those row for row; a plan read from text, or a node registered passthrough, skipped that). One
// that runs whole reads its saved tensors at full length, as it should.
void check_passthrough_nodes(const Graph& g, const PlanData& plan, const TokenIndex& ix, const char* who) {
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    if (plan.nodes[i].fields.empty() || plan.nodes[i].run_whole || find_node_fields(*g.nodes[i])) continue;
    auto* saved = custom_saved(*g.nodes[i]);
    if (!saved) continue;
    for (size_t k = 0; k < saved->size(); ++k) {
      if (plan.nodes[i].find(FieldKind::kSaved, static_cast<int32_t>(k))) continue;
      auto raw = (*saved)[k].get_raw_data();
      if (!raw || !raw->defined()) continue;
      for (int64_t size : raw->sizes()) {
        if (size != ix.T() && size != ix.B() * ix.T()) continue;
        throw Error(
            fmt::format("{}: node #{} {} saves a token-shaped tensor ([{}]) the plan does not cut, which its backward "
                        "would read at full length; re-trace the plan, or write the op with torch operations",
                        who, i, plan.nodes[i].type, fmt::join(raw->sizes(), ", ")));
      }
    }
  }
}

// Everything a rewrite writes, checked and computed, nothing written yet (Transaction::commit):
// the table of edits (edits/table.cpp) run on the graph.
std::unique_ptr<Transaction> prepare_rewrite(const Graph& g, const PlanData& data,
                                             const std::shared_ptr<TokenIndex>& ix, bool exact, bool masked,
                                             bool keep_sources, FilterStats& stats, const char* who) {
  register_routes(g, data, *ix, who);
  auto tx = std::make_unique<Transaction>(data, ix, /*cut_keys=*/!exact, masked, keep_sources, stats, who);
  run_edits(g, *tx);
  return tx;
}

// The gradients reaching the graph's leaves (the parameters' AccumulateGrad nodes) from one run of
// the backward that keeps the graph and writes no .grad.
torch::autograd::variable_list leaf_gradients(const torch::Tensor& loss, const torch::autograd::edge_list& leaves) {
  return torch::autograd::Engine::get_default_engine().execute(
      {torch::autograd::impl::gradient_edge(loss)}, {torch::ones_like(loss)}, /*keep_graph=*/true,
      /*create_graph=*/false, /*accumulate_grad=*/false, leaves);
}

// The gradients at `at` from one backward with rewrite r written (commit: write it first); r is
// reverted (discarded) afterwards unless keep, and on any failure.
torch::autograd::variable_list gradients_with(Transaction& r, bool commit, bool keep, const torch::Tensor& loss,
                                              const torch::autograd::edge_list& at) {
  if (commit) r.commit();
  torch::autograd::variable_list out;
  try {
    out = leaf_gradients(loss, at);
  } catch (...) {
    r.revert();
    throw;
  }
  if (!keep) r.revert();
  return out;
}

// The largest difference of `got` from `want`, relative to want's largest entry or to `floor`, whichever is
// larger (NaN counts as infinite).
double relative_difference(const torch::Tensor& want, const torch::Tensor& got, double floor = 0) {
  torch::Tensor w = want.defined() ? want.to(torch::kDouble) : torch::zeros_like(got, torch::kDouble);
  torch::Tensor h = got.defined() ? got.to(torch::kDouble) : torch::zeros_like(w);
  const double scale = std::max(w.abs().max().item<double>(), floor);
  const double diff = (h - w).abs().max().item<double>();
  const double rel = scale > 0 ? diff / scale : diff;
  return std::isnan(rel) ? INFINITY : rel;
}

// After a check found a leaf's gradient different, with the filtered rewrite `rw` still written: the
// first node, in backward order, whose incoming gradient differs between the filtered rewrite and a
// masked one prepared anew (the masked gradient cut to the kept rows as the filtered one is), and the
// node that made that gradient. Both backwards run again; rw is reverted (discarded) on return, and so
// is the masked rewrite. "" where none is found.
std::string first_differing_node(const torch::Tensor& loss, const Graph& g, const PlanData& data,
                                 const std::shared_ptr<TokenIndex>& ix, bool exact, Transaction& rw, double tol,
                                 const char* who) {
  torch::autograd::edge_list edges;
  std::vector<std::pair<int, uint32_t>> at;  // (node, input) of each edge
  for (size_t i = 1; i < g.nodes.size(); ++i) {
    for (uint32_t k = 0; k < g.nodes[i]->num_inputs(); ++k) {
      edges.emplace_back(g.nodes[i], k);
      at.emplace_back(static_cast<int>(i), k);
    }
  }
  const auto got = gradients_with(rw, /*commit=*/false, /*keep=*/false, loss, edges);
  FilterStats masked_stats;
  auto ref = prepare_rewrite(g, data, ix, exact, /*masked=*/true, /*keep_sources=*/true, masked_stats, who);
  const auto want = gradients_with(*ref, /*commit=*/true, /*keep=*/false, loss, edges);
  std::vector<int> rank(g.nodes.size());
  const std::vector<int> order = topological_order(g);
  for (size_t r = 0; r < order.size(); ++r) rank[order[r]] = static_cast<int>(r);
  int first = -1;
  double first_rel = 0;
  torch::NoGradGuard no_grad;
  for (size_t e = 0; e < edges.size(); ++e) {
    const auto [i, k] = at[e];
    if (first >= 0 && rank[i] >= rank[first]) continue;
    if (!want[e].defined() && !got[e].defined()) continue;
    torch::Tensor w = want[e];
    torch::Tensor h = got[e];
    const FieldSpec* spec = data.nodes[i].find(FieldKind::kInputMeta, static_cast<int32_t>(k));
    try {
      if (spec && spec->shape.has_token() && w.defined()) {
        w = ix->zero_padding(ix->cut(w, spec->shape, !exact), spec->shape, false);
        if (h.defined()) h = ix->zero_padding(h, spec->shape, false);
      }
      const double rel = w.defined() && h.defined() && w.sizes() != h.sizes() ? INFINITY : relative_difference(w, h);
      if (rel > tol) first = i, first_rel = rel;
    } catch (const std::exception&) {
      continue;  // a gradient this comparison cannot cut: pass over it
    }
  }
  if (first < 0 || g.parents[first].empty()) return "";
  const int from = g.parents[first].front().first;  // the node that made the gradient
  return fmt::format("{} (#{}), in the gradient it passes to {} (#{}) (relative difference {:.3g})",
                     data.nodes[from].type, from, data.nodes[first].type, first, first_rel);
}

// validate: the filtered backward's gradient of every leaf against the masked method's on the same
// graph (each rewrite written, run, and the masked one swapped back). On a difference above the
// dtype's tolerance the graph is left as it was and GradientMismatch names the first node whose
// gradient differs; on any other failure, Error.
void validate_against_masked(const torch::Tensor& loss, const Graph& g, const PlanData& data,
                             const std::shared_ptr<TokenIndex>& ix, bool exact, Transaction& rw, const char* who) {
  torch::autograd::edge_list leaves;
  for (const auto& n : g.nodes)
    if (n->num_inputs() == 1 && n->next_edges().empty() && traits_of(n->name()).leaf) leaves.emplace_back(n, 0);
  FilterStats ref_stats;
  auto ref = prepare_rewrite(g, data, ix, exact, /*masked=*/true, /*keep_sources=*/true, ref_stats, who);
  const auto want = gradients_with(*ref, /*commit=*/true, /*keep=*/false, loss, leaves);
  const auto got = gradients_with(rw, /*commit=*/true, /*keep=*/true, loss, leaves);
  const auto dtype = loss.scalar_type();
  const double tol = dtype == torch::kDouble ? 1e-4 : dtype == torch::kFloat ? 1e-3 : 5e-2;
  double worst = 0;
  size_t worst_leaf = 0;
  {
    torch::NoGradGuard no_grad;
    // Each leaf's difference relative to its own largest entry, but never to less than tol times the
    // step's largest gradient entry: a leaf whose true gradient is zero (a key bias: softmax ignores a
    // constant per row) holds rounding noise that two orders of summation make different.
    double largest = 0;
    for (size_t k = 0; k < leaves.size(); ++k)
      if (want[k].defined()) largest = std::max(largest, want[k].abs().max().item<double>());
    for (size_t k = 0; k < leaves.size(); ++k) {
      if (!want[k].defined() && !got[k].defined()) continue;
      const double rel = relative_difference(want[k], got[k], tol * largest);
      if (rel > worst) worst = rel, worst_leaf = k;
    }
  }
  if (worst <= tol) return;
  std::string node;
  try {
    node = first_differing_node(loss, g, data, ix, exact, rw, tol, who);  // reverts rw
  } catch (const std::exception&) {
    node.clear();  // the diagnosis is a courtesy: the refusal stands without it (rw is reverted)
  }
  const auto& meta = leaves[worst_leaf].function->input_metadata(0);
  throw GradientMismatch(fmt::format(
      "{}(check): the filtered gradient differs from mask_backward's{} by {:.3g} (relative, a parameter of shape "
      "[{}]; tolerance {:.0e}); the graph is unchanged, so a plain loss.backward() gives the loss_only gradient. "
      "Please report it with the model",
      who, node.empty() ? "" : ", first at node " + node + ",", worst,
      fmt::join(to_ints(meta.shape_as_dim_vector()), ", "), tol));
}

// The check on first use (FilterOptions::check_every): counts the step, and says whether to check it:
// the first step of its kind (variant, exact_query, ragged) and every check_every-th step. Not where
// the graph holds a declared passthrough node, whose work (FSDP2's reduce-scatter) must run once, nor
// saved tensors behind saved-tensor hooks (below).
bool due_for_check(const Plan& plan, const Graph& g, int64_t variant, bool exact, bool ragged,
                   const FilterOptions& opts) {
  if (opts.check_every <= 0) return false;
  // Saved tensors behind hooks: selective activation checkpointing lets each recomputed region be
  // unpacked once, and the check's two backwards would use that up.
  struct Hooked : IgnoringFieldVisitor {
    bool any = false;
    void saved(const char*, SavedVariable& v) override { any = any || v.has_hooks(); }
    void saved_list(const char*, std::vector<SavedVariable>& v) override {
      for (auto& x : v) any = any || x.has_hooks();
    }
  } hooked;
  for (const auto& n : g.nodes) {
    if (is_passthrough(n->name())) return false;
    if (const NodeFields* f = find_node_fields(*n)) f->visit(n.get(), hooked);
    if (hooked.any) return false;
  }
  auto& log = *plan.impl().checks;
  std::lock_guard<std::mutex> lock(log.mutex);
  ++log.steps;
  return log.steps % opts.check_every == 0 ||
         !log.checked.count({variant, static_cast<int64_t>(g.nodes.size()), exact, ragged});
}

FilterStats run_rewrite(const torch::Tensor& loss, const torch::Tensor& keep_BT, const Plan& plan,
                        const FilterOptions& opts, bool masked) {
  const char* who = masked ? "mask_backward" : "filter_backward";
  NvtxRange range(masked ? "collider/mask" : "collider/filter");
  const auto t0 = std::chrono::steady_clock::now();
  if (!keep_BT.defined() || keep_BT.dim() != 2) {
    throw Error(fmt::format("{}: the keep mask must be bool [B, T]", who));
  }
  const bool exact = opts.attention == AttentionGrad::kExactQuery;
  if (loss.defined() && loss.grad_fn() && rewritten_graphs().contains(loss_root(loss.grad_fn()))) {
    throw Error(fmt::format(
        "{}: this loss's graph was already rewritten by filter_backward or mask_backward; call one of them once "
        "per loss, right before loss.backward()",
        who));
  }
  int64_t variant = -1;
  auto [g, matched] = checked_graph(loss, plan, keep_BT.size(0), who, variant);
  const PlanData& data = *matched;
  if (exact && !data.exact_query_blocker.empty()) {
    throw Error(
        fmt::format("{}: exact_query needs every attention core recognised: {}", who, data.exact_query_blocker));
  }
  const auto [loss_B, loss_T] = loss_tokens(g, data);
  if (loss_B > 0 && (loss_B != keep_BT.size(0) || loss_T != keep_BT.size(1))) {
    throw Error(
        fmt::format("{}: the keep mask is [{}, {}] but the loss was computed on [{}, {}] positions; give the mask the "
                    "hidden states' [B, T] (collider.hf.keep_mask_from_labels derives it from labels)",
                    who, keep_BT.size(0), keep_BT.size(1), loss_B, loss_T));
  }
  const auto t_graph = std::chrono::steady_clock::now();
  auto ix = std::make_shared<TokenIndex>(keep_BT.to(loss.device()));
  check_passthrough_nodes(g, data, *ix, who);
  check_loss_ignores_dropped(loss, g, data, *ix, who);
  const auto t_index = std::chrono::steady_clock::now();
  FilterStats stats;
  stats.nodes_visited = static_cast<int64_t>(g.nodes.size());
  stats.batch = ix->B();
  stats.seq_len = ix->T();
  stats.kept = ix->N();
  stats.kept_total = ix->kept_total();
  stats.kept_min = *std::min_element(ix->kept_counts().begin(), ix->kept_counts().end());
  stats.kept_max = *std::max_element(ix->kept_counts().begin(), ix->kept_counts().end());

  const bool check = !masked && (opts.validate || due_for_check(plan, g, variant, exact, ix->ragged(), opts));
  auto rw = prepare_rewrite(g, data, ix, exact, masked, check, stats, who);
  if (check) {
    validate_against_masked(loss, g, data, ix, exact, *rw, who);
  } else {
    rw->commit();  // from here on nothing can fail
  }
  rw->finish();
  if (check) {
    stats.checked = 1;
    auto& log = *plan.impl().checks;
    std::lock_guard<std::mutex> lock(log.mutex);
    log.checked.emplace(variant, static_cast<int64_t>(g.nodes.size()), exact, ix->ragged());
  }
  rewritten_graphs().add(g.nodes.front());
  stats.rewrite_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (debug_gather()) {
    auto ms = [](auto a, auto b) { return std::chrono::duration<double, std::milli>(b - a).count(); };
    // "rest" (field visits, size edits, releases) includes the time of the per-gather lines above.
    fmt::print(stderr, "collider rewrite {:.2f} ms: graph+check {:.2f}, index {:.2f}, gathers {:.2f}, rest {:.2f}\n",
               stats.rewrite_ms, ms(t0, t_graph), ms(t_graph, t_index), stats.gather_ms,
               stats.rewrite_ms - ms(t0, t_index) - stats.gather_ms);
  }
  return stats;
}

}  // namespace
}  // namespace detail

// The prepare pass can meet a failure of a tensor op (a TORCH_CHECK, an allocation): it leaves
// as collider::Error too, the graph untouched.
static FilterStats rewrite_or_refuse(const torch::Tensor& loss, const torch::Tensor& keep_BT, const Plan& plan,
                                     const FilterOptions& opts, bool masked) {
  const char* who = masked ? "mask_backward" : "filter_backward";
  try {
    return detail::run_rewrite(loss, keep_BT, plan, opts, masked);
  } catch (const Error&) { throw; } catch (const std::exception& e) {
    const std::string what = detail::first_line(e.what());
    if (what.find("backward through the graph a second time") != std::string::npos) {
      throw Error(
          fmt::format("{}: loss.backward() already ran on this loss (its saved tensors are freed); call {} before "
                      "loss.backward(), once per loss",
                      who, who));
    }
    throw Error(fmt::format("{}: refused, the graph is unchanged (a plain backward gives the loss_only gradient): {}",
                            who, what));
  }
}

FilterStats filter_backward(const torch::Tensor& loss, const torch::Tensor& keep_BT, const Plan& plan,
                            const FilterOptions& opts) {
  return rewrite_or_refuse(loss, keep_BT, plan, opts, /*masked=*/false);
}

FilterStats mask_backward(const torch::Tensor& loss, const torch::Tensor& keep_BT, const Plan& plan,
                          const FilterOptions& opts) {
  return rewrite_or_refuse(loss, keep_BT, plan, opts, /*masked=*/true);
}

}  // namespace collider
