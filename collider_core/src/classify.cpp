// Classifying traced fields into token, batch and flattened dimensions (see classify.h).
#include "classify.h"

#include "node_traits.h"

#include <collider/collider.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <functional>
#include <map>
#include <numeric>

namespace collider::detail {

// Classifies one field from its two observations. Returns false (and `why`) for dimensions that
// scale with B or T in a way the rewriter cannot cut.
bool classify(const Observed& a, const Observed& b, Sizes sa, Sizes sb, ShapeSpec& spec, std::string& why,
              bool allow_routed) {
  spec = ShapeSpec{};
  if (a.values.size() != b.values.size()) {
    why = fmt::format("rank {} in one trace and {} in the other", a.values.size(), b.values.size());
    return false;
  }
  spec.rank = static_cast<int32_t>(a.values.size());
  for (size_t d = 0; d < a.values.size(); ++d) {
    const int64_t x = a.values[d], y = b.values[d];
    DimSpec ds;
    ds.dim = static_cast<int32_t>(d);
    // A value that is 0 in both traces is a constant (a slice start, an empty KV cache), never
    // a token or batch dimension: 0 is a multiple of every B*T, so the tests below would take it.
    if (x == 0 && y == 0) continue;
    if (x == sa.T && y == sb.T) {
      ds.kind = DimKind::kToken;
    } else if (x % (sa.B * sa.T) == 0 && y % (sb.B * sb.T) == 0 && x / (sa.B * sa.T) == y / (sb.B * sb.T)) {
      ds.kind = DimKind::kFlatToken;  // [B, mult, T] flattened
      ds.mult = x / (sa.B * sa.T);
    } else if (x > sa.T && x - sa.T == y - sb.T && x - sa.T <= kMaxTokenPlus) {
      ds.kind = DimKind::kTokenPlus;  // T positions and a few fixed ones (attention sinks); checked by trace_plan
      ds.mult = x - sa.T;
    } else if (x == y) {
      continue;  // constant
    } else if (x % sa.B == 0 && y % sb.B == 0 && x / sa.B == y / sb.B) {
      ds.kind = DimKind::kBatch;
      ds.mult = x / sa.B;
    } else if (allow_routed) {
      ds.kind = DimKind::kRouted;  // its route is assigned by assign_routes, or the field is refused
    } else {
      why = fmt::format(
          "dimension {} has size {} for (B={}, T={}) and {} for (B={}, T={}), which is neither "
          "T, B*T nor a multiple of B",
          d, x, sa.B, sa.T, y, sb.B, sb.T);
      return false;
    }
    spec.dims.push_back(ds);
  }
  return true;
}

std::vector<int32_t> token_dims(const ShapeSpec& s) {
  std::vector<int32_t> out;
  for (const auto& d : s.dims)
    if (d.kind == DimKind::kToken || d.kind == DimKind::kTokenPlus) out.push_back(d.dim);
  return out;
}
const DimSpec* batch_dim(const ShapeSpec& s) {
  for (const auto& d : s.dims)
    if (d.kind == DimKind::kBatch) return &d;
  return nullptr;
}
bool has_flat(const ShapeSpec& s) {
  for (const auto& d : s.dims)
    if (d.flat()) return true;
  return false;
}

// A flattened token dimension of size B*mult*T has the same size whether the batch or the
// sequence came first, so its row order cannot be read from sizes. It is read from the reshapes
// that make or undo a flattening: a view whose input sizes (self_sym_sizes) have a token and a
// batch dimension while its output (the node's input metadata) is flat, or the reverse. Nodes
// joined by an edge whose tensor is flat see the same rows, so they share one order: every
// reshape of such a group must agree. A group without a reshape keeps the batch-major order of
// batch-first models, unless the graph has sequence-first tensors ([T, B, ..]): then it is refused.
// A batch-major flat dimension of B*mult*T rows is [B, mult, T] flattened (row = (b*mult + j)*T + t:
// attention's [B, H, T, ..] -> [B*H*T, ..]). [B, T, k] flattened (row = (b*T + t)*k + j: a per-head
// norm's [B, T, H, D] -> [B*T*H, D]) has the same size and another order: a reshape whose rows
// between the batch and the sequence are not the mult shows it, and its rows are cut k per kept
// position (kFlatPerToken). Rows from both sides of the sequence ([B, m, T, k] -> [B*m*T*k]) are
// refused. The rows before the sequence are read from the sizes (the split's before its token
// dimension over the flat one's before its flat dimension), so a trace of one sequence (B = 1, no
// batch dimension to see) tells the orders apart as well.
enum class FlatOrder { kUnknown, kBatchMajor, kPerToken };
static FlatOrder order_after_the_batch(const NodeSpec& ns, int i, const FieldSpec& flat, const FieldSpec& split,
                                       const ObservedNode& observed, int64_t B) {
  const auto toks = token_dims(split.shape);
  const DimSpec* flat_dim = nullptr;
  for (const auto& d : flat.shape.dims)
    if (d.kind == DimKind::kFlatToken) flat_dim = &d;
  if (!flat_dim) return FlatOrder::kUnknown;
  auto sizes_of = [&](const FieldSpec& f) -> const std::vector<int64_t>* {
    for (const auto& o : observed.fields)
      if (o.name == f.name && o.kind == f.kind && o.item == f.item) return &o.values;
    return nullptr;
  };
  const auto *split_sizes = sizes_of(split), *flat_sizes = sizes_of(flat);
  if (!split_sizes || !flat_sizes || static_cast<int32_t>(split_sizes->size()) <= toks[0] ||
      static_cast<int32_t>(flat_sizes->size()) <= flat_dim->dim) {
    return FlatOrder::kUnknown;
  }
  int64_t before_split = 1, before_flat = 1;
  for (int32_t d = 0; d < toks[0]; ++d) before_split *= (*split_sizes)[d];
  for (int32_t d = 0; d < flat_dim->dim; ++d) before_flat *= (*flat_sizes)[d];
  if (before_flat == 0 || before_split % before_flat != 0 || (before_split / before_flat) % B != 0) {
    return FlatOrder::kUnknown;
  }
  const int64_t between = before_split / before_flat / B;  // [B*m, T, ..] -> [B*m*T, ..]: m
  if (between == flat_dim->mult) return FlatOrder::kBatchMajor;
  if (between == 1) return FlatOrder::kPerToken;
  throw Error(fmt::format(
      "collider cannot rewrite node {} (#{}): it flattens rows from both sides of the sequence ([B, m, T, k, ..] "
      "-> [B*m*T*k, ..], m = {}, k = {}) into one dimension, an order of rows collider does not cut; flatten "
      "[B, m*k, T, ..] or [B, T, m*k, ..], or keep the positions a dimension of their own",
      ns.type, i, between, flat_dim->mult / std::max<int64_t>(between, 1)));
}

void resolve_flat_order(const Graph& g, PlanData& plan, const std::vector<ObservedNode>& observed) {
  const int n = static_cast<int>(plan.nodes.size());
  auto flat_input = [&](int c, int64_t input_nr) {
    for (const auto& f : plan.nodes[c].fields)
      if (f.kind == FieldKind::kInputMeta && f.item == input_nr && has_flat(f.shape)) return true;
    return false;
  };
  std::vector<int> root(n);
  std::iota(root.begin(), root.end(), 0);
  std::function<int(int)> find = [&](int i) { return root[i] == i ? i : root[i] = find(root[i]); };
  bool any_flat = false, seq_first_tensor = false;
  for (int i = 0; i < n; ++i) {
    for (const auto& f : plan.nodes[i].fields) {
      any_flat = any_flat || has_flat(f.shape);
      const DimSpec* b = batch_dim(f.shape);
      for (const auto& d : f.shape.dims)
        if (b && d.kind == DimKind::kToken && d.dim < b->dim) seq_first_tensor = true;
    }
    for (const auto& e : g.nodes[i]->next_edges()) {
      if (!e.function) continue;
      const int c = g.index.at(e.function.get());
      if (flat_input(c, e.input_nr)) root[find(i)] = find(c);
    }
  }
  if (!any_flat) return;
  // group -> the reshapes showing it
  std::map<int, std::vector<std::string>> batch_major, token_major, per_token;
  for (int i = 0; i < n; ++i) {
    const NodeSpec& ns = plan.nodes[i];
    const FieldSpec *in_sizes = nullptr, *out_meta = nullptr;
    for (const auto& f : ns.fields) {
      if (f.kind == FieldKind::kSizes && f.name == "self_sym_sizes") in_sizes = &f;
      if (f.kind == FieldKind::kInputMeta && f.item == 0) out_meta = &f;
    }
    if (!in_sizes || !out_meta) continue;
    const FieldSpec* flat = has_flat(out_meta->shape) ? out_meta : has_flat(in_sizes->shape) ? in_sizes : nullptr;
    const FieldSpec* split = flat == out_meta ? in_sizes : out_meta;
    if (!flat || has_flat(split->shape)) continue;
    const DimSpec* b = batch_dim(split->shape);
    auto toks = token_dims(split->shape);
    if ((!b && plan.batch_a != 1) || toks.size() != 1) continue;
    const bool sequence_first = b && toks[0] < b->dim;
    const FlatOrder order =
        sequence_first ? FlatOrder::kUnknown : order_after_the_batch(ns, i, *flat, *split, observed[i], plan.batch_a);
    (sequence_first                   ? token_major
     : order == FlatOrder::kPerToken ? per_token
                                      : batch_major)[find(i)]
        .push_back(fmt::format("#{} {}", i, ns.type));
  }
  for (int i = 0; i < n; ++i) {
    const int r = find(i);
    const bool bm = batch_major.count(r) > 0, tm = token_major.count(r) > 0, pt = per_token.count(r) > 0;
    if (bm + tm + pt > 1) {
      auto says = [&](const char* order, std::map<int, std::vector<std::string>>& by) {
        return by.count(r) ? fmt::format("{} according to {}", order, by[r].front()) : std::string();
      };
      std::vector<std::string> orders;
      for (auto s : {says("batch-major", batch_major), says("sequence-major", token_major),
                     says("k rows per position", per_token)})
        if (!s.empty()) orders.push_back(s);
      throw Error(fmt::format("collider cannot rewrite node {} (#{}): its flattened batch and sequence rows are "
                              "{}; reshape from one layout only",
                              plan.nodes[i].type, i, fmt::join(orders, " and ")));
    }
    bool flat_here = false;
    for (const auto& f : plan.nodes[i].fields) flat_here = flat_here || has_flat(f.shape);
    if (!flat_here) continue;
    if (!bm && !tm && seq_first_tensor) {
      throw Error(
          fmt::format("collider cannot rewrite node {} (#{}): it has a dimension of B*T rows, and no reshape "
                      "next to it shows whether the batch or the sequence came first (the model has "
                      "sequence-first [T, B, ..] tensors); flatten with view/reshape from the [B, T, ..] "
                      "or [T, B, ..] tensor",
                      plan.nodes[i].type, i));
    }
    if (!tm && !pt) continue;
    for (auto& f : plan.nodes[i].fields)
      for (auto& d : f.shape.dims)
        if (d.kind == DimKind::kFlatToken) d.kind = tm ? DimKind::kFlatSeqFirst : DimKind::kFlatPerToken;
  }
}

std::optional<RefLayout> layout_of(const ShapeSpec& s) {
  if (s.pad_rank > 0) {
    RefLayout r;
    r.rank = s.pad_rank;
    r.batch_dim = s.bcast_batch_dim;
    r.mult = s.bcast_mult;
    const int32_t off = s.pad_rank - s.rank;
    for (int32_t t : token_dims(s)) r.tokens.push_back(t + off);
    return r;
  }
  const DimSpec* b = batch_dim(s);
  auto toks = token_dims(s);
  if (!b || toks.empty()) return std::nullopt;
  return RefLayout{s.rank, b->dim, b->mult, toks};
}

// Gives a batch-less token field a broadcast layout against `ref` (see ShapeSpec).
bool align_broadcast(ShapeSpec& s, const std::vector<int64_t>& values, const RefLayout& ref) {
  auto toks = token_dims(s);
  if (toks.empty() || ref.tokens.empty()) return false;
  // Align the last token dim of the field with the last token dim of the reference.
  const int32_t off = ref.tokens.back() - toks.back();
  if (off < 0) return false;
  for (int32_t t : toks) {
    if (std::find(ref.tokens.begin(), ref.tokens.end(), t + off) == ref.tokens.end()) return false;
  }
  const int32_t bd = ref.batch_dim;
  if (bd < off) {
    // the batch dimension lies in the padded leading region
  } else if (bd - off < static_cast<int32_t>(values.size()) && values[bd - off] == 1) {
    // an explicit size-1 batch dimension
  } else {
    return false;
  }
  s.pad_rank = s.rank + off;
  s.bcast_batch_dim = bd;
  s.bcast_mult = ref.mult;
  return true;
}

// For an op that indexes or mixes along `dim`: does `dim` address a token dimension of the
// field? Ops without a `dim` field (convolutions) count as mixing.
bool along_token_dim(const ObservedNode& node, const Observed& field, const ShapeSpec& spec) {
  if (!node.dim) return true;
  // Conservative: a saved index tensor may hold token positions. Not for top-k, sort and gather,
  // whose indices are positions along their own `dim` (a router's top-k over experts).
  if (field.kind == FieldKind::kSaved && !traits_of(node.type).indexes_own_dim) return true;
  const int64_t rank = static_cast<int64_t>(field.values.size());
  const int64_t d = *node.dim < 0 ? *node.dim + rank : *node.dim;
  for (const auto& ds : spec.dims)
    if (ds.dim == d && ds.kind != DimKind::kBatch) return true;
  return false;
}

// A concatenation along the token dimension onto empty tensors (a Hugging Face model's KV cache
// at the first step: cat([B, G, 0, E], [B, G, T, E])) keeps every position where it was, so its
// rows can be cut like any token-wise op. Any other concatenation along tokens is refused.
bool is_cat_onto_empty(const ObservedNode& a, const ObservedNode& b, Sizes sa, Sizes sb) {
  if (!traits_of(a.type).cat || !a.dim) return false;
  int carrying = 0;
  for (size_t k = 0; k < a.fields.size(); ++k) {
    const Observed& fa = a.fields[k];
    const Observed& fb = b.fields[k];
    if (fa.name != "tensors_args_sizes_symint") continue;
    const int64_t rank = static_cast<int64_t>(fa.values.size());
    const int64_t d = *a.dim < 0 ? *a.dim + rank : *a.dim;
    if (d < 0 || d >= rank || fb.values.size() != fa.values.size()) return false;
    if (fa.values[d] == 0 && fb.values[d] == 0) continue;
    if (fa.values[d] != sa.T || fb.values[d] != sb.T) return false;
    ++carrying;
  }
  return carrying == 1;
}

}  // namespace collider::detail
