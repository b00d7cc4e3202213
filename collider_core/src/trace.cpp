// trace_plan: finds, for every node of the loss graph, which fields carry token dimensions.
// The loss is built twice on dummy batches (B_a, T_a) and (B_b, T_b) of sizes no model uses;
// a dimension is a token dimension when it equals T (or B*T) in both traces, a batch dimension
// when it is B times the same constant in both. Attention cores (QK^T -> softmax -> PV) are
// located structurally so exact_query knows query rows from key columns.
// Tests: tests/test_collider_*.cpp.
#include <collider/collider.h>

#include "graph.h"
#include "node_fields.h"
#include "plan_impl.h"
#include "sdpa.h"

#include <fmt/format.h>

#include <algorithm>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <numeric>
#include <optional>
#include <set>

namespace collider {
namespace detail {

std::mutex& passthrough_mutex() {
  static std::mutex m;
  return m;
}
std::set<std::string>& passthrough_nodes() {
  static std::set<std::string> s;
  return s;
}
bool is_passthrough(const std::string& name) {
  std::lock_guard<std::mutex> lock(passthrough_mutex());
  return passthrough_nodes().count(name) > 0;
}

namespace {

// One field as seen in one trace.
struct Observed {
  std::string name;
  FieldKind kind = FieldKind::kSaved;
  int32_t item = 0;
  std::vector<int64_t> values;  // tensor sizes, or the entries of a sizes field
  bool scalar = false;          // a single c10::SymInt field
  bool defined = true;
};

struct ObservedNode {
  std::string type;
  bool generated = false;
  std::string described;  // saved fields, for messages
  std::vector<Observed> fields;
  std::optional<int64_t> dim;  // an `int64_t dim` field, for token-mixing checks
};

std::vector<int64_t> to_ints(c10::SymIntArrayRef a) {
  std::vector<int64_t> out;
  out.reserve(a.size());
  for (const auto& s : a) out.push_back(s.expect_int());
  return out;
}

// Records every field of one node.
class RecordVisitor final : public FieldVisitor {
 public:
  RecordVisitor(ObservedNode& out, const std::shared_ptr<torch::autograd::Node>& node) : out_(out), node_(node) {}

  void saved(const char* name, SavedVariable& v) override { add_saved(name, v, 0); }
  void saved_list(const char* name, std::vector<SavedVariable>& v) override {
    for (size_t i = 0; i < v.size(); ++i) add_saved(name, v[i], static_cast<int32_t>(i));
  }
  void sizes(const char* name, std::vector<c10::SymInt>& v) override { add_sizes(name, to_ints(v), 0); }
  void sizes_list(const char* name, std::vector<std::vector<c10::SymInt>>& v) override {
    for (size_t i = 0; i < v.size(); ++i) add_sizes(name, to_ints(v[i]), static_cast<int32_t>(i));
  }
  void symint(const char* name, c10::SymInt& v) override { add_scalar(name, v.expect_int()); }
  void opt_symint(const char* name, std::optional<c10::SymInt>& v) override {
    if (v) add_scalar(name, v->expect_int());
  }
  void opt_sizes(const char* name, c10::OptionalArray<c10::SymInt>& v) override {
    if (v.list) add_sizes(name, to_ints(*v.list), 0);
  }
  void int_sizes(const char* name, std::vector<int64_t>& v) override { add_sizes(name, v, 0); }
  void type_and_size(const char* name, torch::autograd::generated::TypeAndSize& v) override {
    add_sizes(name, to_ints(v.sym_sizes), 0);
  }
  void geometry(const char* name, at::TensorGeometry& v) override {
    Observed o{name, FieldKind::kSizes, 0, to_ints(v.sym_sizes()), false, true};
    o.name = std::string("geometry:") + name;  // read-only: may not carry token dims
    out_.fields.push_back(std::move(o));
  }
  void int64(const char* name, int64_t& v) override {
    if (std::string(name) == "dim") out_.dim = v;
  }

 private:
  void add_saved(const char* name, SavedVariable& v, int32_t item) {
    Observed o;
    o.name = name;
    o.kind = FieldKind::kSaved;
    o.item = item;
    at::Tensor t;
    try {
      t = v.unpack(node_);
    } catch (const std::exception& e) {
      throw Error(fmt::format("trace_plan: cannot read saved tensor {} of {} ({}); was backward already run "
                              "on this loss?", name, out_.type, e.what()));
    }
    o.defined = t.defined();
    if (t.defined()) o.values = t.sizes().vec();
    out_.fields.push_back(std::move(o));
  }
  void add_sizes(const char* name, std::vector<int64_t> values, int32_t item) {
    const std::string n(name);
    const bool strides = n.size() > 8 && n.compare(n.size() - 8, 8, "_strides") == 0;
    out_.fields.push_back(Observed{n, strides ? FieldKind::kStrides : FieldKind::kSizes, item, std::move(values)});
  }
  void add_scalar(const char* name, int64_t value) {
    Observed o{name, FieldKind::kSizes, 0, {value}, true, true};
    out_.fields.push_back(std::move(o));
  }
  ObservedNode& out_;
  const std::shared_ptr<torch::autograd::Node>& node_;
};

ObservedNode observe(const std::shared_ptr<torch::autograd::Node>& node) {
  ObservedNode out;
  out.type = node->name();
  if (const NodeFields* nf = find_node_fields(*node)) {
    out.generated = true;
    out.described = nf->described_fields;
    RecordVisitor rec(out, node);
    nf->visit(node.get(), rec);
  }
  for (uint32_t i = 0; i < node->num_inputs(); ++i) {
    const auto& meta = node->input_metadata(i);
    Observed o;
    o.name = "input";
    o.kind = FieldKind::kInputMeta;
    o.item = static_cast<int32_t>(i);
    if (meta.is_nested_tensor() || meta.is_cpp_nested_tensor()) {
      o.defined = false;
    } else {
      o.values = to_ints(meta.shape_as_dim_vector());
    }
    out.fields.push_back(std::move(o));
  }
  return out;
}

struct Sizes {
  int64_t B, T;
};

// Classifies one field from its two observations. Returns false (and `why`) for dimensions that
// scale with B or T in a way the rewriter cannot cut.
bool classify(const Observed& a, const Observed& b, Sizes sa, Sizes sb, ShapeSpec& spec, std::string& why) {
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
    } else if (x == y) {
      continue;  // constant
    } else if (x % sa.B == 0 && y % sb.B == 0 && x / sa.B == y / sb.B) {
      ds.kind = DimKind::kBatch;
      ds.mult = x / sa.B;
    } else {
      why = fmt::format("dimension {} has size {} for (B={}, T={}) and {} for (B={}, T={}), which is neither "
                        "T, B*T nor a multiple of B", d, x, sa.B, sa.T, y, sb.B, sb.T);
      return false;
    }
    spec.dims.push_back(ds);
  }
  return true;
}

std::vector<int32_t> token_dims(const ShapeSpec& s) {
  std::vector<int32_t> out;
  for (const auto& d : s.dims)
    if (d.kind == DimKind::kToken) out.push_back(d.dim);
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
void resolve_flat_order(const Graph& g, PlanData& plan) {
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
  std::map<int, std::vector<std::string>> batch_major, token_major;  // group -> the reshapes showing it
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
    if (!b || toks.size() != 1) continue;
    (toks[0] < b->dim ? token_major : batch_major)[find(i)].push_back(fmt::format("#{} {}", i, ns.type));
  }
  for (int i = 0; i < n; ++i) {
    const int r = find(i);
    const bool bm = batch_major.count(r) > 0, tm = token_major.count(r) > 0;
    if (bm && tm) {
      throw Error(fmt::format("collider cannot rewrite node {} (#{}): its flattened batch and sequence rows are "
                              "batch-major according to {} and sequence-major according to {}; reshape from one "
                              "layout only", plan.nodes[i].type, i, batch_major[r].front(), token_major[r].front()));
    }
    bool flat_here = false;
    for (const auto& f : plan.nodes[i].fields) flat_here = flat_here || has_flat(f.shape);
    if (!flat_here) continue;
    if (!bm && !tm && seq_first_tensor) {
      throw Error(fmt::format("collider cannot rewrite node {} (#{}): it has a dimension of B*T rows, and no reshape "
                              "next to it shows whether the batch or the sequence came first (the model has "
                              "sequence-first [T, B, ..] tensors); flatten with view/reshape from the [B, T, ..] "
                              "or [T, B, ..] tensor", plan.nodes[i].type, i));
    }
    if (!tm) continue;
    for (auto& f : plan.nodes[i].fields)
      for (auto& d : f.shape.dims)
        if (d.kind == DimKind::kFlatToken) d.kind = DimKind::kFlatSeqFirst;
  }
}

// A reference layout: rank, batch position and multiplier, token positions (padded coordinates).
struct RefLayout {
  int32_t rank = 0;
  int32_t batch_dim = -1;
  int64_t mult = 1;
  std::vector<int32_t> tokens;
};

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

const std::set<std::string>& token_mixing_nodes() {
  // Ops that mix tokens along a dimension; cutting rows would change their meaning.
  static const std::set<std::string> k = {
      "CumsumBackward0", "CumprodBackward0", "LogcumsumexpBackward0", "FlipBackward0", "RollBackward0",
      "SortBackward0", "TopkBackward0", "SliceBackward0", "SelectBackward0", "NarrowBackward0",
      "IndexSelectBackward0", "GatherBackward0", "UnfoldBackward0", "ConstantPadNdBackward0",
      "ConvolutionBackward0", "CumulativeTrapezoidBackward0", "DiffBackward0", "MaxBackward0",
      "MinBackward0", "MaxBackward1", "MinBackward1", "SplitBackward0", "SplitWithSizesBackward0",
      "UnsafeSplitBackward0", "UnsafeSplitWithSizesBackward0", "CatBackward0", "StackBackward0"};
  return k;
}

// For an op that indexes or mixes along `dim`: does `dim` address a token dimension of the
// field? Ops without a `dim` field (convolutions) count as mixing.
bool along_token_dim(const ObservedNode& node, const Observed& field, const ShapeSpec& spec) {
  if (!node.dim) return true;
  if (field.kind == FieldKind::kSaved) return true;  // conservative: index tensors over tokens
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
  if (a.type != "CatBackward0" || !a.dim) return false;
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

// What to do about a refused token-mixing node, where a common cause is known.
std::string mixing_hint(const std::string& type) {
  if (type == "CatBackward0" || type == "StackBackward0") {
    return " (a KV cache concatenates along the sequence: with Hugging Face transformers pass use_cache=False "
           "to the training forward)";
  }
  return "";
}

bool is_softmax(const std::string& t) { return t == "SoftmaxBackward0"; }
bool is_bmm(const std::string& t) { return t == "BmmBackward0"; }
bool is_shape_or_scale(const std::string& t) {
  static const std::set<std::string> k = {
      "ToCopyBackward0", "ExpandBackward0", "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0",
      "CloneBackward0", "MaskedFillBackward0", "AddBackward0", "AddBackward1", "MulBackward0", "MulBackward1",
      "DivBackward0", "DivBackward1", "WhereBackward0", "SubBackward0", "SubBackward1"};
  return k.count(t) > 0;
}

bool is_sdpa(const std::string& t) { return t.rfind("ScaledDotProduct", 0) == 0 || t.rfind("Efficient", 0) == 0; }

std::vector<int> topological_order(const Graph& g) {
  const int n = static_cast<int>(g.nodes.size());
  std::vector<int> indeg(n, 0);
  for (int i = 0; i < n; ++i) indeg[i] = static_cast<int>(g.parents[i].size());
  std::deque<int> q;
  for (int i = 0; i < n; ++i)
    if (indeg[i] == 0) q.push_back(i);
  std::vector<int> order;
  while (!q.empty()) {
    int i = q.front();
    q.pop_front();
    order.push_back(i);
    for (const auto& e : g.nodes[i]->next_edges()) {
      if (!e.function) continue;
      int c = g.index.at(e.function.get());
      if (--indeg[c] == 0) q.push_back(c);
    }
  }
  return order;
}

}  // namespace

// Locates attention cores: softmax over a [.., Tq, Tk] score tensor, the batched matmul that
// made the scores (Q K^T) and the one that consumes the probabilities (P V).
void find_attention_cores(const Graph& g, PlanData& plan) {
  const int n = static_cast<int>(g.nodes.size());
  auto type = [&](int i) -> const std::string& { return plan.nodes[i].type; };
  auto two_token_field = [&](int i) {
    for (const auto& f : plan.nodes[i].fields)
      if (token_dims(f.shape).size() >= 2) return true;
    return false;
  };
  std::vector<std::string> problems;
  for (int s = 0; s < n; ++s) {
    if (!is_softmax(type(s)) || !two_token_field(s)) continue;
    std::vector<int> core = {s};
    // Down (toward the inputs): the score chain to the QK^T matmul.
    int cur = s, qk = -1;
    for (int steps = 0; steps < 16; ++steps) {
      int next = -1;
      for (const auto& e : g.nodes[cur]->next_edges()) {
        if (e.function) {
          next = g.index.at(e.function.get());
          break;
        }
      }
      if (next < 0) break;
      if (is_bmm(type(next))) {
        qk = next;
        break;
      }
      if (!is_shape_or_scale(type(next))) break;
      core.push_back(next);
      cur = next;
    }
    // Up (toward the loss): the probability chain to the PV matmul (P is its first operand).
    cur = s;
    int pv = -1;
    for (int steps = 0; steps < 16 && pv < 0; ++steps) {
      if (g.parents[cur].size() != 1) break;
      auto [p, edge] = g.parents[cur][0];
      if (is_bmm(type(p))) {
        if (edge == 0) pv = p;
        break;
      }
      if (!is_shape_or_scale(type(p))) break;
      core.push_back(p);
      cur = p;
    }
    if (qk < 0 || pv < 0) {
      problems.push_back(fmt::format("softmax node #{} over a [.., T, T] score tensor is not between two batched "
                                     "matmuls (QK^T, PV) through shape/scale ops", s));
      continue;
    }
    core.push_back(qk);
    core.push_back(pv);
    for (int c : core) plan.nodes[c].attention_core = true;
    ++plan.num_attention_cores;
    // Roles: in core nodes a field with two token dims is [.., Tq, Tk]; in the matmuls the
    // second operand (mat2: K^T or V) is key-side.
    for (int c : core) {
      for (auto& f : plan.nodes[c].fields) {
        auto toks = token_dims(f.shape);
        const bool mat2 = f.name.rfind("mat2", 0) == 0;
        int seen = 0;
        for (auto& d : f.shape.dims) {
          if (d.kind != DimKind::kToken) continue;
          if (mat2 && (c == qk || c == pv)) d.role = Role::kKey;
          else if (toks.size() >= 2 && seen == 1) d.role = Role::kKey;
          ++seen;
        }
      }
    }
    // Gradient edges into K^T (qk, edge 1) and V (pv, edge 1) carry all key rows.
    for (int m : {qk, pv}) {
      const FieldSpec* sizes = nullptr;
      for (const auto& f : plan.nodes[m].fields)
        if ((f.name == "mat2_" || f.name == "mat2_sym_sizes") && !sizes) sizes = &f;
      if (!sizes) {
        problems.push_back(fmt::format("matmul node #{} has no token-shaped mat2 sizes", m));
        continue;
      }
      plan.inserts.push_back(EdgeInsert{m, 1, sizes->shape});
    }
  }
  // Every two-token-dim field outside a recognised core, and every SDPA node, blocks exact_query.
  for (int i = 0; i < n; ++i) {
    if (plan.nodes[i].attention_core) continue;
    if (plan.nodes[i].fused_attention) continue;
    if (is_sdpa(type(i))) {
      problems.push_back(fmt::format("node #{} {}: no filtered replacement for this fused attention", i, type(i)));
      continue;
    }
    for (const auto& f : plan.nodes[i].fields) {
      if (token_dims(f.shape).size() >= 2) {
        problems.push_back(fmt::format("node #{} {} field {} has two token dimensions outside a recognised "
                                       "attention core", i, type(i), f.name));
        break;
      }
    }
  }
  std::string joined;
  for (const auto& p : problems) joined += (joined.empty() ? "" : "; ") + p;
  plan.exact_query_blocker = joined;
}

PlanData build_plan(const Graph& ga, const Graph& gb, Sizes sa, Sizes sb) {
  PlanData plan;
  plan.batch_a = sa.B;
  plan.seq_a = sa.T;
  plan.batch_b = sb.B;
  plan.seq_b = sb.T;
  const size_t n = ga.nodes.size();
  if (gb.nodes.size() != n) {
    throw Error(fmt::format("trace_plan: the loss graph has {} nodes for (B={}, T={}) but {} for (B={}, T={}); "
                            "the model's graph must not depend on the batch or sequence size",
                            n, sa.B, sa.T, gb.nodes.size(), sb.B, sb.T));
  }
  std::vector<ObservedNode> oa(n), ob(n);
  for (size_t i = 0; i < n; ++i) {
    oa[i] = observe(ga.nodes[i]);
    ob[i] = observe(gb.nodes[i]);
    if (oa[i].type != ob[i].type || oa[i].fields.size() != ob[i].fields.size()) {
      throw Error(fmt::format("trace_plan: node #{} is {} in one trace and {} in the other; the graph must not "
                              "depend on the batch or sequence size", i, oa[i].type, ob[i].type));
    }
  }
  plan.nodes.resize(n);
  // Raw classification.
  std::vector<std::vector<std::vector<int64_t>>> values(n);  // trace-a values per kept field
  for (size_t i = 0; i < n; ++i) {
    NodeSpec& ns = plan.nodes[i];
    ns.type = oa[i].type;
    if (is_fused_attention_node(ns.type)) {
      ns.fused_attention = true;  // replaced whole at filter time
      continue;
    }
    for (size_t k = 0; k < oa[i].fields.size(); ++k) {
      const Observed& a = oa[i].fields[k];
      const Observed& b = ob[i].fields[k];
      if (!a.defined || !b.defined) continue;
      if (a.kind == FieldKind::kStrides) continue;  // recomputed from the sibling sizes when those are cut
      ShapeSpec spec;
      std::string why;
      if (!classify(a, b, sa, sb, spec, why)) {
        throw Error(fmt::format("collider cannot rewrite node {} (#{}): field {} {}. Saved fields: {}",
                                ns.type, i, a.name, why, oa[i].described.empty() ? "(none)" : oa[i].described));
      }
      if (!spec.has_token()) continue;
      if (a.scalar) {
        if (a.name.find("numel") != std::string::npos) continue;  // a divisor fixed by the forward (mean)
        throw Error(fmt::format("collider cannot rewrite node {} (#{}): scalar field {} equals the sequence length; "
                                "the op indexes along the token dimension. Saved fields: {}",
                                ns.type, i, a.name, oa[i].described));
      }
      if (a.name.rfind("geometry:", 0) == 0) {
        throw Error(fmt::format("collider cannot rewrite node {} (#{}): field {} (a TensorGeometry) has token "
                                "dimensions", ns.type, i, a.name.substr(9)));
      }
      if (!oa[i].generated && a.kind == FieldKind::kInputMeta && ns.type.find("CompiledFunction") != std::string::npos) {
        throw Error(fmt::format("collider cannot rewrite node {} (#{}): it is a torch.compile (AOTAutograd) graph, "
                                "whose saved activations live inside compiled code the rewriter cannot cut. Trace "
                                "and filter the model without torch.compile.", ns.type, i));
      }
      if (!oa[i].generated && a.kind == FieldKind::kInputMeta && !is_passthrough(ns.type) &&
          ns.type != "torch::autograd::AccumulateGrad") {
        throw Error(fmt::format("collider cannot rewrite node {} (#{}): it is not an ATen op (no field handler "
                                "generated from Functions.h) and its input has token dimensions. If it maps "
                                "gradients row for row and saves nothing token-shaped, declare it with "
                                "collider::register_passthrough_node(\"{}\").", ns.type, i, ns.type));
      }
      if (token_mixing_nodes().count(ns.type) && along_token_dim(oa[i], a, spec) &&
          !is_cat_onto_empty(oa[i], ob[i], sa, sb)) {
        throw Error(fmt::format("collider cannot rewrite node {} (#{}): it mixes or indexes positions along a "
                                "token dimension (field {}); filtering rows would change its result{}",
                                ns.type, i, a.name, mixing_hint(ns.type)));
      }
      ns.fields.push_back(FieldSpec{a.name, a.kind, a.item, spec});
      values[i].push_back(a.values);
    }
  }
  resolve_flat_order(ga, plan);
  // Broadcast layouts, resolved parents-first. With B = 1 a batch-less token field is cut as it
  // is (every row belongs to the one sequence).
  std::vector<std::optional<RefLayout>> node_ref(n);
  for (int i : sa.B == 1 ? std::vector<int>{} : topological_order(ga)) {
    NodeSpec& ns = plan.nodes[i];
    std::optional<RefLayout> ref;
    for (const auto& f : ns.fields)  // input metadata first, then saved fields
      if (f.kind == FieldKind::kInputMeta && !ref) ref = layout_of(f.shape);
    for (const auto& f : ns.fields)
      if (!ref) ref = layout_of(f.shape);
    if (!ref) {
      for (const auto& [p, e] : ga.parents[i])
        if (!ref && node_ref[p]) ref = node_ref[p];
    }
    for (size_t k = 0; k < ns.fields.size(); ++k) {
      FieldSpec& f = ns.fields[k];
      if (batch_dim(f.shape) || has_flat(f.shape)) continue;
      if (!ref || !align_broadcast(f.shape, values[i][k], *ref)) {
        throw Error(fmt::format("collider cannot rewrite node {} (#{}): field {} has token dimensions but no "
                                "batch dimension, and no batch-carrying tensor of the node or its consumers "
                                "shows how it broadcasts", ns.type, i, f.name));
      }
    }
    if (!ref) {
      for (const auto& f : ns.fields)
        if (!ref && f.kind == FieldKind::kInputMeta) ref = layout_of(f.shape);
    }
    node_ref[i] = ref;
  }
  find_attention_cores(ga, plan);
  return plan;
}

}  // namespace detail

void register_passthrough_node(const std::string& node_name) {
  std::lock_guard<std::mutex> lock(detail::passthrough_mutex());
  detail::passthrough_nodes().insert(node_name);
}

static Plan trace_plan_impl(const LossOnBatchFn& loss_on_random_batch, const TraceOptions& opts) {
  if (!loss_on_random_batch) throw Error("trace_plan: no loss function given");
  auto build = [&](int64_t B, int64_t T) {
    torch::Tensor loss = loss_on_random_batch(B, T);
    if (!loss.defined() || !loss.requires_grad() || !loss.grad_fn()) {
      throw Error("trace_plan: the loss function must return a loss that requires grad (build it from the "
                  "model's parameters, outside torch::NoGradGuard)");
    }
    if (loss.numel() != 1) throw Error("trace_plan: the loss must be a scalar");
    return loss;
  };
  if (opts.batch_a < 2 || opts.batch_b < 2 || opts.batch_a == opts.batch_b || opts.seq_a == opts.seq_b) {
    throw Error("trace_plan: the two trace batches must differ and be >= 2, and the two sequence lengths differ");
  }
  auto plan_for = [&](int64_t Ba, int64_t Bb) {
    torch::Tensor la = build(Ba, opts.seq_a);
    torch::Tensor lb = build(Bb, opts.seq_b);
    detail::Graph ga = detail::collect_graph(la.grad_fn());
    detail::Graph gb = detail::collect_graph(lb.grad_fn());
    return detail::build_plan(ga, gb, {Ba, opts.seq_a}, {Bb, opts.seq_b});
  };
  Plan plan;
  plan.impl().data = plan_for(opts.batch_a, opts.batch_b);
  plan.impl().single = plan_for(1, 1);
  return plan;
}

// Only collider::Error leaves: a failure of the loss function or of a tensor op while tracing
// is reported as one (first line of the message; c10::Error appends a C++ backtrace).
Plan trace_plan(const LossOnBatchFn& loss_on_random_batch, const TraceOptions& opts) {
  try {
    return trace_plan_impl(loss_on_random_batch, opts);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    std::string what = e.what();
    throw Error("trace_plan: building or tracing the loss failed: " + what.substr(0, what.find('\n')));
  }
}

}  // namespace collider
