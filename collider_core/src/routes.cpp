// Mixture-of-experts routes (see routes.h): finding them in a traced plan, reading their index
// when a plan is replayed.
#include "routes.h"

#include "node_fields.h"
#include "node_traits.h"
#include "sdpa.h"
#include "token_index.h"

#include <collider/collider.h>

#include <torch/csrc/autograd/generated/Functions.h>

#include <fmt/format.h>

#include <algorithm>
#include <deque>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace collider::detail {

namespace {

[[noreturn]] void refuse(const NodeSpec& ns, int i, const std::string& why) {
  throw Error(fmt::format("collider cannot rewrite node {} (#{}): {}", ns.type, i, why));
}

// Whether `s` has the [B*T] token rows, batch-major, at `dim` and no other token dimension. In
// the plan of one-row batches (B = 1) those rows are the [T] token dimension itself.
bool token_rows_at(const ShapeSpec& s, int32_t dim, bool one_row) {
  bool rows = false;
  for (const auto& d : s.dims) {
    if (d.kind == DimKind::kBatch) return false;
    if (d.dim == dim && ((d.kind == DimKind::kFlatToken && d.mult == 1) || (one_row && d.kind == DimKind::kToken))) {
      rows = true;
    } else {
      return false;
    }
  }
  return rows;
}

FieldSpec* field(NodeSpec& ns, FieldKind kind, const std::string& name, int32_t item = 0) {
  for (auto& f : ns.fields)
    if (f.kind == kind && f.name == name && f.item == item) return &f;
  return nullptr;
}

bool any_routed(const NodeSpec& ns) {
  for (const auto& f : ns.fields)
    if (f.shape.has_routed()) return true;
  return false;
}

// Gives node i's routed dimensions route r.
void claim(NodeSpec& ns, int i, int32_t r) {
  for (auto& f : ns.fields) {
    for (auto& d : f.shape.dims) {
      if (!d.routed()) continue;
      if (d.route >= 0 && d.route != r)
        refuse(ns, i, fmt::format("it is in two mixture-of-experts routes (#{}, #{})", d.route, r));
      d.route = r;
    }
  }
}

bool is_index_op(const std::string& type) {
  return type.rfind("Index", 0) == 0 || type.find("Scatter") != std::string::npos ||
         type.find("Gather") != std::string::npos || type.find("MaskedSelect") != std::string::npos;
}

// Gives node x's fields a routed dimension wherever a dimension has the route's lengths in the
// two traces (rows_a, rows_b), adding the fields that classify() left without one: a route that
// received no token in either trace has 0 rows in both, which classify() reads as a constant
// (no field of a route is empty otherwise). Returns whether the node has routed fields now.
bool mark_routed_fields(const std::vector<ObservedNode>& oa, const std::vector<ObservedNode>& ob, PlanData& plan, int x,
                        int64_t rows_a, int64_t rows_b) {
  NodeSpec& xs = plan.nodes[x];
  bool any = false;
  for (size_t k = 0; k < oa[x].fields.size() && k < ob[x].fields.size(); ++k) {
    const Observed& a = oa[x].fields[k];
    const Observed& b = ob[x].fields[k];
    if (!a.defined || !b.defined || a.scalar || a.kind == FieldKind::kStrides || a.values.size() != b.values.size()) {
      continue;
    }
    std::vector<int32_t> dims;
    for (size_t d = 0; d < a.values.size(); ++d)
      if (a.values[d] == rows_a && b.values[d] == rows_b) dims.push_back(static_cast<int32_t>(d));
    if (dims.empty()) continue;
    if (dims.size() > 1) refuse(xs, x, fmt::format("field {} has two dimensions of a route's length", a.name));
    FieldSpec* f = field(xs, a.kind, a.name, a.item);
    if (!f) {
      ShapeSpec spec;
      spec.rank = static_cast<int32_t>(a.values.size());
      spec.dims.push_back(DimSpec{dims[0], DimKind::kRouted, Role::kQuery, 1});
      xs.fields.push_back(FieldSpec{a.name, a.kind, a.item, spec});
    } else if (f->shape.dims.size() != 1 || f->shape.dims[0].dim != dims[0] || !f->shape.dims[0].routed()) {
      refuse(xs, x,
             fmt::format("field {} mixes a mixture-of-experts route's rows with other dimensions that scale", a.name));
    }
    any = true;
  }
  return any;
}

// The source side of scatter s: row-wise ops on the routed rows down to the gathers.
void walk_route(const Graph& g, const std::vector<ObservedNode>& oa, const std::vector<ObservedNode>& ob,
                PlanData& plan, int s, int64_t rows_a, int64_t rows_b) {
  std::vector<int> stack;
  const auto& edges = g.nodes[s]->next_edges();
  if (edges.size() > 1 && edges[1].function) stack.push_back(g.index.at(edges[1].function.get()));
  std::set<int> seen;
  while (!stack.empty()) {
    const int x = stack.back();
    stack.pop_back();
    if (!seen.insert(x).second) continue;
    NodeSpec& xs = plan.nodes[x];
    if (!mark_routed_fields(oa, ob, plan, x, rows_a, rows_b)) continue;  // off the route (an expert's weight)
    if (traits_of(xs.type).route == RouteRole::kGather) {
      // The gather: rows of the [B*T, ..] token rows by the route's index (indices_[0]); a second
      // index of routed rows picks along another dimension (the top-k slot of a routing weight).
      const FieldSpec* self = field(xs, FieldKind::kSizes, "self_sym_sizes");
      if (!self || !token_rows_at(self->shape, 0, plan.batch_a == 1)) {
        refuse(xs, x,
               "it indexes a mixture-of-experts route's rows; collider follows a route only when it is "
               "gathered from the [B*T] token rows (hidden_states[index])");
      }
      for (auto& f : xs.fields) {
        if (f.kind != FieldKind::kSaved || f.name != "indices_") continue;
        if (f.shape.rank != 1 || f.shape.dims.size() != 1 || !f.shape.dims[0].routed()) {
          refuse(xs, x, "its indices are not all one index per routed row");
        }
        f.shape.dims[0].kind = f.item == 0 ? DimKind::kRoutedPositions : DimKind::kRouted;
      }
      claim(xs, x, s);
      continue;  // below it: the token rows
    }
    if (is_index_op(xs.type))
      refuse(xs, x, "an index op inside a mixture-of-experts route, which collider does not follow");
    for (const auto& f : xs.fields) {
      for (const auto& d : f.shape.dims) {
        if (!d.routed() && d.kind != DimKind::kBatch) {
          refuse(xs, x, fmt::format("field {} mixes a mixture-of-experts route's rows with token rows", f.name));
        }
      }
    }
    claim(xs, x, s);
    for (const auto& e : g.nodes[x]->next_edges())
      if (e.function) stack.push_back(g.index.at(e.function.get()));
  }
}

// B*T*mult flattened rows in either order (a trace of one sequence shows the top-k pairs' [T, k] ->
// [T*k] as k rows per position; of several, [B*T, k] -> [B*T*k] shows no order and reads batch-major).
bool flat_token_rows(const DimSpec& d) { return d.kind == DimKind::kFlatToken || d.kind == DimKind::kFlatPerToken; }

// A field with one scaling dimension, dimension 0 of B*T*mult flattened rows: its DimSpec.
const DimSpec* flat_rows(const FieldSpec* f) {
  if (!f || f->shape.dims.size() != 1) return nullptr;
  const DimSpec& d = f->shape.dims[0];
  return d.dim == 0 && flat_token_rows(d) ? &d : nullptr;
}

// Grouped experts (transformers' grouped_mm experts), one route per layer, named after node x:
//   pairs_S = top_k_index.reshape(-1); perm_S = sort(pairs_S)     (S = B*T*k token-expert pairs)
//   rows_SD = hidden_MD[perm_S // k]            (IndexBackward0, the gather: kRoutedPositions)
//   w_S     = top_k_weights.reshape(-1)[perm_S] (IndexBackward0, the weights: kRoutedSlots)
//   out_SD  = grouped_mm(rows_SD, W, offs) ... * w_S  (GroupedMmBackward0: offs is kRoutedOffsets)
//   back_SD = out_SD[inverse_S]                 (IndexBackward0 x: kTokenSlots, names the route)
//   final_MD = back_SD.view(M, k, D).sum(1)
// Every [S] dimension between x and the gathers becomes the route's rows (classify() took them as
// B*T*k flattened rows, which they are in number but not in order). Returns whether x is such a
// route; plan nodes change only then. Refuses what it cannot follow inside one.
bool assign_sorted_route(const Graph& g, const std::vector<ObservedNode>& observed, PlanData& plan, int x) {
  NodeSpec& xs = plan.nodes[x];
  const DimSpec* out = flat_rows(field(xs, FieldKind::kSizes, "self_sym_sizes"));
  const FieldSpec* inverse = field(xs, FieldKind::kSaved, "indices_", 0);
  const DimSpec* slots = flat_rows(inverse);
  if (!out || !slots || out->mult != slots->mult || slots->mult < 2 || inverse->shape.rank != 1 ||
      field(xs, FieldKind::kSaved, "indices_", 1)) {
    return false;
  }
  const int64_t k = slots->mult;
  auto pairs = [k](const DimSpec& d) { return flat_token_rows(d) && d.mult == k; };
  std::map<int, NodeSpec> changed;  // written to the plan once the route is complete
  int gathers = 0;
  std::vector<int> stack{g.index.at(g.nodes[x]->next_edges().at(0).function.get())};
  std::set<int> seen;
  while (!stack.empty()) {
    const int y = stack.back();
    stack.pop_back();
    if (y == x || !seen.insert(y).second) continue;
    NodeSpec ys = plan.nodes[y];
    bool on_route = false;
    for (const auto& f : ys.fields)
      for (const auto& d : f.shape.dims) on_route = on_route || pairs(d);
    if (!on_route) continue;  // an expert's weight
    bool descend = true;
    if (traits_of(ys.type).route == RouteRole::kGather) {
      FieldSpec* self = field(ys, FieldKind::kSizes, "self_sym_sizes");
      FieldSpec* index = field(ys, FieldKind::kSaved, "indices_", 0);
      const DimSpec* by = flat_rows(index);
      if (!by || !pairs(*by) || index->shape.rank != 1 || field(ys, FieldKind::kSaved, "indices_", 1)) {
        refuse(ys, y, "it indexes grouped experts' rows by more than one index per row");
      }
      DimSpec& d = index->shape.dims[0];
      if (self && token_rows_at(self->shape, 0, plan.batch_a == 1)) {  // the gather from the token rows
        d.kind = DimKind::kRoutedPositions;
        ++gathers;
      } else if (self && flat_rows(self) && pairs(*flat_rows(self)) && self->shape.rank == 1) {  // the weights
        d.kind = DimKind::kRoutedSlots;
      } else if (!self || !self->shape.has_token()) {  // a parameter by expert (biases)
        d.kind = DimKind::kRouted;
      } else {
        refuse(ys, y,
               "it gathers grouped experts' rows from a tensor other than the [B*T] token rows or top-k weights");
      }
      d.route = x;
      if (d.kind != DimKind::kRoutedSlots) d.mult = 1;
      descend = false;  // below it: token rows, weights or parameters
    } else if (is_index_op(ys.type)) {
      refuse(ys, y, "an index op inside grouped experts, which collider does not follow");
    }
    for (auto& f : ys.fields) {
      // An index op's index is done above; the tensor it gathers from (token rows, weights) is cut as such.
      if (traits_of(ys.type).route == RouteRole::kGather && (f.kind == FieldKind::kSaved || f.name == "self_sym_sizes"))
        continue;
      for (auto& d : f.shape.dims) {
        if (!pairs(d)) { refuse(ys, y, fmt::format("field {} mixes grouped experts' rows with token rows", f.name)); }
        d = DimSpec{d.dim, DimKind::kRouted, Role::kQuery, 1, x};
      }
    }
    if (traits_of(ys.type).route == RouteRole::kExperts) {
      bool offsets = false;
      for (const auto& o : observed[y].fields) offsets = offsets || (o.name == "offs_" && o.defined);
      if (!offsets) refuse(ys, y, "a grouped matmul without offsets, which collider does not follow");
      ShapeSpec offs;
      offs.rank = 1;
      offs.dims.push_back(DimSpec{0, DimKind::kRoutedOffsets, Role::kQuery, 1, x});
      ys.fields.push_back(FieldSpec{"offs_", FieldKind::kSaved, 0, offs});
    }
    changed[y] = std::move(ys);
    if (!descend) continue;
    for (const auto& e : g.nodes[y]->next_edges())
      if (e.function) stack.push_back(g.index.at(e.function.get()));
  }
  if (gathers == 0) return false;  // no gather from the token rows: not experts (refused below)
  for (auto& [y, ns] : changed) plan.nodes[y] = std::move(ns);
  for (auto& f : xs.fields) {
    if (f.kind == FieldKind::kSizes && f.name == "self_sym_sizes")
      f.shape.dims[0] = DimSpec{0, DimKind::kRouted, Role::kQuery, 1, x};
    if (f.kind == FieldKind::kSaved && f.name == "indices_" && f.item == 0) {
      f.shape.dims[0] = DimSpec{0, DimKind::kTokenSlots, Role::kQuery, k, x};
    }
  }
  return true;
}

}  // namespace

void assign_routes(const Graph& g, const std::vector<ObservedNode>& oa, const std::vector<ObservedNode>& ob, Sizes sa,
                   Sizes sb, PlanData& plan, const std::vector<RoutedCandidate>& candidates) {
  const auto& observed = oa;
  const int n = static_cast<int>(plan.nodes.size());
  // Grouped experts first (in graph order, the route's own IndexBackward0 before its weights').
  for (int x = 0; x < n; ++x) {
    if (traits_of(plan.nodes[x].type).route == RouteRole::kGather && !any_routed(plan.nodes[x]))
      assign_sorted_route(g, observed, plan, x);
  }
  for (int s = 0; s < n; ++s) {
    NodeSpec& ns = plan.nodes[s];
    if (traits_of(ns.type).route != RouteRole::kScatter) continue;
    const FieldSpec* in = ns.find(FieldKind::kInputMeta, 0);
    if (!in || !in->shape.has_token()) continue;  // not into token rows: an unclaimed routed field is refused below
    // The route's length in the two traces: one the batch's own sizes could explain (the same in
    // both, T, B*T, a multiple of B) would make its rows indistinguishable from those dimensions,
    // except 0 in both (an expert that received no token: no other dimension is empty).
    int64_t rows_a = -1, rows_b = -1;
    for (size_t k = 0; k < oa[s].fields.size(); ++k) {
      const Observed& a = oa[s].fields[k];
      const Observed& b = ob[s].fields[k];
      if (a.name != "index_" || a.values.size() != 1 || b.values.size() != 1) continue;
      rows_a = a.values[0];
      rows_b = b.values[0];
      ShapeSpec ordinary;
      std::string why;
      if (!(rows_a == 0 && rows_b == 0) && classify(a, b, sa, sb, ordinary, why)) {
        throw AmbiguousRoute(fmt::format(
            "trace_plan: an expert of the mixture-of-experts layer at node {} (#{}) received {} and {} tokens in the "
            "two traces (B={}, T={} and B={}, T={}), sizes that cannot be told from the batch's own",
            ns.type, s, a.values[0], b.values[0], sa.B, sa.T, sb.B, sb.T));
      }
    }
    if (rows_a >= 0) mark_routed_fields(oa, ob, plan, s, rows_a, rows_b);
    FieldSpec* index = field(ns, FieldKind::kSaved, "index_");
    if (!index || !index->shape.has_routed()) {
      refuse(ns, s,
             "it adds rows into token rows by an index whose length does not follow the batch; collider "
             "cannot cut that index");
    }
    if (observed[s].dim.value_or(-1) != 0 || !token_rows_at(in->shape, 0, plan.batch_a == 1) ||
        index->shape.rank != 1) {
      refuse(ns, s, "it adds routed rows into a tensor other than the [B*T, ..] token rows (along dimension 0)");
    }
    index->shape.dims[0].kind = DimKind::kRoutedPositions;
    claim(ns, s, s);
    walk_route(g, oa, ob, plan, s, rows_a, rows_b);
  }
  for (const auto& c : candidates) {
    const NodeSpec& ns = plan.nodes[c.node];
    for (const auto& f : ns.fields) {
      if (f.name != c.field) continue;
      for (const auto& d : f.shape.dims) {
        if (!d.routed() || d.route >= 0) continue;
        const RouteRole route = traits_of(ns.type).route;
        const bool moe = route == RouteRole::kScatter || route == RouteRole::kGather || route == RouteRole::kRouter;
        throw Error(fmt::format("collider cannot rewrite node {} (#{}): field {} {}.{}", ns.type, c.node, c.field,
                                c.why,
                                moe ? " Collider does not follow this routing of tokens; use "
                                      "experts_implementation=\"eager\" or method loss_only"
                                    : ""));
      }
    }
  }
  // A gather from token rows by an index whose length does not follow the batch: after the cut
  // its index would point into the full rows.
  for (int i = 0; i < n; ++i) {
    NodeSpec& ns = plan.nodes[i];
    if (traits_of(ns.type).route != RouteRole::kGather || any_routed(ns)) continue;
    const FieldSpec* self = field(ns, FieldKind::kSizes, "self_sym_sizes");
    if (!self || !self->shape.has_token()) continue;
    for (const auto& o : observed[i].fields) {
      if (o.kind != FieldKind::kSaved || o.name != "indices_" || !o.defined) continue;
      for (const auto& d : self->shape.dims) {
        if (d.dim == o.item && d.kind != DimKind::kBatch) {
          refuse(ns, i,
                 "it gathers token rows by an index that follows no route (top-1 grouped experts, or "
                 "fixed positions), which a cut would leave pointing at the full rows. For transformers' "
                 "mixture-of-experts models set experts_implementation=\"eager\"");
        }
      }
    }
  }
}

namespace {

// Finds a node's saved `index_` (IndexAddBackward0), or the first of its `indices_` (IndexBackward0).
struct IndexField final : IgnoringFieldVisitor {
  SavedVariable* index = nullptr;
  void saved(const char* name, SavedVariable& v) override {
    if (std::string(name) == "index_") index = &v;
  }
  void saved_list(const char* name, std::vector<SavedVariable>& v) override {
    if (std::string(name) == "indices_" && !v.empty()) index = &v[0];
  }
};

// A grouped route's token slots per token: the mult of its node's kTokenSlots index; 0 for a scatter.
int64_t slots_of(const NodeSpec& ns) {
  for (const auto& f : ns.fields)
    for (const auto& d : f.shape.dims)
      if (d.kind == DimKind::kTokenSlots) return d.mult;
  return 0;
}

}  // namespace

void register_routes(const Graph& g, const PlanData& plan, TokenIndex& ix, const char* who) {
  std::set<int32_t> routes;
  for (const auto& ns : plan.nodes)
    for (const auto& f : ns.fields)
      for (const auto& d : f.shape.dims)
        if (d.routed()) routes.insert(d.route);
  for (int32_t r : routes) {
    const auto& node = g.nodes.at(r);
    const NodeFields* nf = find_node_fields(*node);
    IndexField reader;
    if (nf) nf->visit(node.get(), reader);
    const int64_t slots = slots_of(plan.nodes.at(r));
    if (!reader.index) throw Error(fmt::format("{}: node #{} is not a mixture-of-experts scatter (plan bug)", who, r));
    if (reader.index->has_hooks()) {  // read when the backward reaches it (make_hooked_scatter)
      ix.add_hooked_route(r, node->input_metadata(0).device());
      continue;
    }
    torch::Tensor index;
    try {
      index = reader.index->unpack(node);
    } catch (const std::exception& e) {
      throw Error(
          fmt::format("{}: cannot read the index of node #{} {}. Call filter_backward once per "
                      "loss, before loss.backward()",
                      who, r, node->name()));
    }
    if (slots > 0) {
      ix.add_sorted_route(r, index, slots);
    } else {
      ix.add_route(r, index);
    }
  }
}

namespace {

// Whether plan node p is the scatter of a route (the node the route is named after).
bool is_route_scatter(const PlanData& plan, int32_t p) {
  if (traits_of(plan.nodes[p].type).route != RouteRole::kScatter) return false;
  for (const auto& f : plan.nodes[p].fields)
    for (const auto& d : f.shape.dims)
      if (d.routed() && d.route == p) return true;
  return false;
}

// Plan nodes reachable from the source side of the scatters in `dropped` (their edges after the first).
std::vector<char> below_dropped(const PlanData& plan, const std::set<int32_t>& dropped) {
  std::vector<char> seen(plan.nodes.size(), 0);
  std::vector<int32_t> stack;
  for (int32_t s : dropped)
    for (size_t k = 1; k < plan.children[s].size(); ++k)
      if (plan.children[s][k] >= 0) stack.push_back(plan.children[s][k]);
  while (!stack.empty()) {
    const int32_t x = stack.back();
    stack.pop_back();
    if (seen[x]) continue;
    seen[x] = 1;
    for (int32_t c : plan.children[x])
      if (c >= 0) stack.push_back(c);
  }
  return seen;
}

}  // namespace

std::optional<PlanData> plan_without_absent_routes(const Graph& g, const std::vector<const std::string*>& types,
                                                   const PlanData& plan) {
  const int ng = static_cast<int>(g.nodes.size());
  const int np = static_cast<int>(plan.nodes.size());
  if (static_cast<int>(plan.children.size()) != np || ng == 0 || np == 0) return std::nullopt;
  auto same = [&](int gi, int32_t pi) {
    const std::string& t = *types[gi];
    return t == plan.nodes[pi].type ||
           (plan.nodes[pi].fused_attention && traits_of(t).fused_attention != FusedAttention::kNone);
  };
  std::vector<int32_t> p_of(ng, -1), g_of(np, -1);
  std::set<int32_t> dropped;
  if (!same(0, 0)) return std::nullopt;
  p_of[0] = 0;
  g_of[0] = 0;
  std::deque<int> queue{0};
  while (!queue.empty()) {
    const int gi = queue.front();
    queue.pop_front();
    const int32_t pi = p_of[gi];
    const auto& edges = g.nodes[gi]->next_edges();
    const auto& children = plan.children[pi];
    for (size_t k = 0; k < std::max(edges.size(), children.size()); ++k) {
      const int gc = k < edges.size() && edges[k].function ? g.index.at(edges[k].function.get()) : -1;
      int32_t pc = k < children.size() ? children[k] : -1;
      // A route the graph lacks: pass over its scatter to the tensor its rows were added into.
      while (pc >= 0 && is_route_scatter(plan, pc) && (gc < 0 || traits_of(*types[gc]).route != RouteRole::kScatter)) {
        if (!dropped.insert(pc).second) return std::nullopt;  // a cycle: not a plan trace_plan wrote
        pc = plan.children[pc].empty() ? -1 : plan.children[pc][0];
      }
      if (gc < 0 && pc < 0) continue;
      if (gc < 0 || pc < 0) return std::nullopt;
      if (p_of[gc] >= 0) {
        if (p_of[gc] != pc) return std::nullopt;
        continue;
      }
      if (g_of[pc] >= 0 || !same(gc, pc)) return std::nullopt;
      p_of[gc] = pc;
      g_of[pc] = gc;
      queue.push_back(gc);
    }
  }
  // Every plan node left unmatched is below a route the graph lacks.
  const std::vector<char> below = below_dropped(plan, dropped);
  for (int32_t p = 0; p < np; ++p)
    if (g_of[p] < 0 && !dropped.count(p) && !below[p]) return std::nullopt;
  PlanData out;  // the plan's own fields; its nodes, edges and inserts in the graph's order below
  out.batch_a = plan.batch_a;
  out.seq_a = plan.seq_a;
  out.batch_b = plan.batch_b;
  out.seq_b = plan.seq_b;
  out.num_attention_cores = plan.num_attention_cores;
  out.exact_query_blocker = plan.exact_query_blocker;
  out.inserts = plan.inserts;
  out.nodes.resize(ng);
  out.children.resize(ng);
  for (int gi = 0; gi < ng; ++gi) {
    NodeSpec ns = plan.nodes[p_of[gi]];
    ns.type = *types[gi];
    for (auto& f : ns.fields) {
      for (auto& d : f.shape.dims) {
        if (!d.routed()) continue;
        if (g_of[d.route] < 0) return std::nullopt;  // in a route the graph lacks
        d.route = g_of[d.route];
      }
    }
    out.nodes[gi] = std::move(ns);
    for (const auto& e : g.nodes[gi]->next_edges())
      out.children[gi].push_back(e.function ? g.index.at(e.function.get()) : -1);
  }
  for (auto& ins : out.inserts) {
    if (g_of[ins.node] < 0) return std::nullopt;  // an attention core in a route the graph lacks
    ins.node = g_of[ins.node];
  }
  out.detached = plan.detached;
  for (auto& e : out.detached) {
    if (g_of[e.node] < 0) return std::nullopt;
    e.node = g_of[e.node];
  }
  return out;
}

HookedScatterNode::HookedScatterNode(NodePtr scatter, std::shared_ptr<TokenIndex> ix)
    : Node(scatter->sequence_nr()), scatter_(std::move(scatter)), ix_(std::move(ix)) {}

void HookedScatterNode::adopt_edges() {
  next_edges_ = scatter_->next_edges();
  topological_nr_ = scatter_->topological_nr();
}

void HookedScatterNode::release_variables() { scatter_->release_variables(); }

torch::autograd::variable_list HookedScatterNode::apply(torch::autograd::variable_list&& grads) {
  torch::NoGradGuard no_grad;
  auto* ia = dynamic_cast<torch::autograd::generated::IndexAddBackward0*>(scatter_.get());
  TORCH_CHECK(ia, "collider: a hooked route's scatter is not IndexAddBackward0 (plan bug)");
  const torch::Tensor& grad_MD = grads.at(0);  // the cut token rows [B*N, ..]
  torch::Tensor source_RD;
  if (grad_MD.defined() && should_compute_output(1)) {
    const torch::Tensor rows_R = ix_->cut_rows_of(ia->index_.unpack(scatter_));
    const torch::Tensor dropped_R = rows_R.lt(0);
    source_RD = grad_MD.index_select(0, rows_R.clamp_min(0));
    std::vector<int64_t> row_shape(static_cast<size_t>(source_RD.dim()), 1);
    row_shape[0] = dropped_R.size(0);
    source_RD.masked_fill_(dropped_R.view(row_shape), 0);
    if (!ia->alpha.equal(1)) source_RD = source_RD * ia->alpha;
  }
  return {should_compute_output(0) ? grad_MD : torch::Tensor(), source_RD};
}

NodePtrOf<HookedScatterNode> make_hooked_scatter(const NodePtr& scatter,
                                                       std::shared_ptr<TokenIndex> ix,
                                                       const std::vector<int64_t>& cut_input_sizes) {
  auto* ia = dynamic_cast<torch::autograd::generated::IndexAddBackward0*>(scatter.get());
  if (!ia || ia->dim != 0 || scatter->num_inputs() != 1 || scatter->next_edges().size() != 2) {
    throw Error(fmt::format("filter_backward: node {} is not a mixture-of-experts scatter along dimension 0 (plan bug)",
                            scatter->name()));
  }
  auto node = make_node<HookedScatterNode>(scatter, std::move(ix));
  const auto& meta = scatter->input_metadata(0);
  node->add_input_metadata(meta.options(), std::vector<c10::SymInt>(cut_input_sizes.begin(), cut_input_sizes.end()),
                           false, false, std::nullopt);
  return node;  // its edges: adopt_edges()
}

}  // namespace collider::detail
