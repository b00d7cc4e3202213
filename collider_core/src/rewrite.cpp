// filter_backward / mask_backward: replay a Plan on the autograd graph of one step.
// filter_backward cuts every token-shaped saved tensor to the kept rows (one gather per distinct
// tensor), shrinks recorded sizes and expected input shapes, and for exact_query inserts a node
// on each key/value edge of an attention core that cuts dK/dV to the kept rows. After it, the
// whole backward runs on [B, N] tokens (DESIGN.md section 3, paper section 4).
// mask_backward computes the same gradients on full-size tensors (the oracle).
// All or nothing: a first pass checks every node against the plan and computes every cut
// tensor, size list and replacement node without touching the graph; only when all of it
// succeeded does a second pass write them in (assignments that cannot fail). After any error
// the graph is as the forward left it, and a plain backward gives the loss_only gradient.
#include <collider/collider.h>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/variable.h>

#include "cpu_kernels.h"
#include "graph.h"
#include "loss_checks.h"
#include "node_fields.h"
#include "nvtx.h"
#include "passthrough.h"
#include "plan_impl.h"
#include "routes.h"
#include "row_attention.h"
#include "slices.h"
#include "saved_cut.h"
#include "sdpa.h"
#include "token_index.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#include <unordered_map>

namespace collider {
namespace detail {
namespace {

using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::variable_list;

std::vector<c10::SymInt> to_syms(const std::vector<int64_t>& v) { return {v.begin(), v.end()}; }

// c10::Error's what() carries a C++ backtrace after the message; the message is its first line.
std::string first_line(const char* what) {
  std::string s(what);
  const auto nl = s.find('\n');
  return nl == std::string::npos ? s : s.substr(0, nl);
}

// Cuts (or zeroes, for the masked method) the gradient flowing into a key/value operand.
class KeyRowsNode final : public Node {
 public:
  KeyRowsNode(std::shared_ptr<TokenIndex> index, ShapeSpec spec, bool zero_only)
      : index_(std::move(index)), spec_(std::move(spec)), zero_only_(zero_only) {}
  std::string name() const override { return zero_only_ ? "collider::MaskKeyRows" : "collider::CutKeyRows"; }
  variable_list apply(variable_list&& grads) override {
    torch::Tensor g = grads.at(0);
    if (!g.defined()) return {g};
    torch::NoGradGuard no_grad;
    if (zero_only_) return {index_->zero_dropped(g, spec_, true)};
    // Padding rows of ragged masks are dropped tokens: their dK/dV are discarded too.
    return {index_->zero_padding_into(index_->cut(g, spec_, /*cut_keys=*/true), g, spec_, /*keys_only=*/false)};
  }

 private:
  std::shared_ptr<TokenIndex> index_;
  ShapeSpec spec_;
  bool zero_only_;
};

// Ragged kept counts: zeroes the padding rows of a gradient where it is born (an edge from a node
// without token dimensions, the loss's reduction, into one with them), so padding positions
// carry no gradient even when the loss does not mask them (see token_index.cpp).
class ZeroPaddingNode final : public Node {
 public:
  ZeroPaddingNode(std::shared_ptr<TokenIndex> index, ShapeSpec spec)
      : index_(std::move(index)), spec_(std::move(spec)) {}
  std::string name() const override { return "collider::ZeroPadding"; }
  variable_list apply(variable_list&& grads) override {
    torch::Tensor g = std::move(grads.at(0));
    if (!g.defined()) return {g};
    torch::NoGradGuard no_grad;
    // A gradient only this node holds (the loss side's fresh [B*N, V] logits gradient) is zeroed
    // in place: out of place, transformers' labels loss paid 19 ms per step for a [1484, 8192]
    // copy (tinyllama-mini shapes, B = 4, T = 512, 2 CPU cores) against ~3 ms in place.
    const bool owned = g.use_count() == 1 && g.storage().use_count() == 1 && g.is_non_overlapping_and_dense();
    return {owned ? index_->zero_padding_in_place(g, spec_) : index_->zero_padding(g, spec_, /*keys_only=*/false)};
  }

 private:
  std::shared_ptr<TokenIndex> index_;
  ShapeSpec spec_;
};

// A leaf tensor with token dimensions (inputs_embeds that require grad; the embedding output that
// transformers' enable_input_require_grads marks when checkpointing a PEFT model): its gradient
// arrives cut and is accumulated full-size, zero at every position the cut left out (the filtered
// semantics give dropped positions no gradient). Stands on every edge into the leaf's
// AccumulateGrad, whose expected shape stays the leaf's.
class FullRowsNode final : public Node {
 public:
  FullRowsNode(std::shared_ptr<TokenIndex> index, ShapeSpec spec, bool cut_keys, std::vector<int64_t> full)
      : index_(std::move(index)), spec_(std::move(spec)), cut_keys_(cut_keys), full_(std::move(full)) {}
  std::string name() const override { return "collider::FullRows"; }
  variable_list apply(variable_list&& grads) override {
    torch::Tensor g = grads.at(0);
    if (!g.defined()) return {g};
    torch::NoGradGuard no_grad;
    return {index_->uncut(g, spec_, cut_keys_, full_)};
  }

 private:
  std::shared_ptr<TokenIndex> index_;
  ShapeSpec spec_;
  bool cut_keys_;
  std::vector<int64_t> full_;
};

// Ragged kept counts: the backward of a GEMM over the token rows, y = x @ W (MmBackward0) or
// y = b + x @ W (AddmmBackward0) with x the [B*T, D] rows of the tokens, run on the S = sum_b N_b
// packed kept rows instead of the B*N padded ones (token_index.cpp says why). The original node
// stays as it is, its token operand and sizes cut to the S packed rows (Rewriter::Apply, packed);
// this node stands in its place in the graph: it takes the padded gradient [B*N, Dout], keeps
// its live rows (padding rows carry zero gradient), calls the original node, and returns its
// token-operand gradient [S, D] in the padded layout with zero padding rows. Both GEMMs (dX =
// dY W^T, dW = X^T dY) then cost what the kept tokens cost; the result is the padded one's.
class PackedRowsNode final : public Node {
 public:
  PackedRowsNode(NodePtr inner, size_t token_output, std::shared_ptr<TokenIndex> index)
      : Node(inner->sequence_nr()), inner_(std::move(inner)), token_output_(token_output), index_(std::move(index)) {}
  std::string name() const override { return "collider::PackedRows"; }
  void release_variables() override { inner_->release_variables(); }
  // The original node's edges, taken after every other edge write of the rewrite (commit).
  void adopt_edges() {
    next_edges_ = inner_->next_edges();
    topological_nr_ = inner_->topological_nr();
  }
  variable_list apply(variable_list&& grads) override {
    torch::Tensor g = grads.at(0);
    if (!g.defined()) return (*inner_)(std::move(grads));
    {
      torch::NoGradGuard no_grad;
      g = gather_rows(g, index_->live_rows(), /*stream=*/false);  // [S, Dout], read by the GEMM next
    }
    variable_list outs = (*inner_)({g});
    torch::Tensor& dx = outs.at(token_output_);  // [S, D]
    if (dx.defined()) {
      torch::NoGradGuard no_grad;
      // live rows copied, padding rows zeroed: one pass over the output, not a memset and a copy
      dx = scatter_rows(dx.contiguous(), index_->live_rows(), index_->padding_rows(), index_->B() * index_->N());
    }
    return outs;
  }

 private:
  NodePtr inner_;
  size_t token_output_;
  std::shared_ptr<TokenIndex> index_;
};

// The next_edge of a GEMM node whose backward can run on packed rows (PackedRowsNode): the token
// operand's, when it is the node's only token-shaped field, a plain [B*T, D] matrix; else -1.
int packed_token_output(const NodeSpec& spec) {
  const char* field = spec.type == "MmBackward0" ? "self_" : spec.type == "AddmmBackward0" ? "mat1_" : nullptr;
  if (!field) return -1;
  bool saved = false;
  for (const auto& f : spec.fields) {
    const ShapeSpec& s = f.shape;
    if (s.rank != 2 || s.pad_rank != 0 || s.dims.size() != 1 || s.dims[0].dim != 0 ||
        s.dims[0].kind != DimKind::kFlatToken || s.dims[0].mult != 1) {
      return -1;
    }
    if (f.kind == FieldKind::kSaved) {
      if (f.name != field) return -1;  // the weight operand is token-shaped: not a token-row GEMM
      saved = true;
    }
  }
  if (!saved) return -1;
  return spec.type == "MmBackward0" ? 0 : 1;
}

// COLLIDER_DEBUG_GATHER=1: one line per gather and the rewrite's phases (read once per process).
bool debug_gather() {
  static const bool on = std::getenv("COLLIDER_DEBUG_GATHER") != nullptr;
  return on;
}

// A saved tensor's identity while the rewrite is prepared (every tensor it keys is held alive by
// the graph and by its SavedCut until the rewrite ends, so an address is never reused meanwhile),
// and what is made of it: tensors with the same key share one cut.
struct CacheKey {
  const void* data;
  int64_t numel;
  int dtype;
  std::vector<int64_t> strides;  // empty for contiguous tensors (views reconciled by their view sizes)
  std::vector<int64_t> sizes;
  bool padding_keys_zeroed = false;  // a cut whose padding keys are zeroed is shared apart
  int64_t cut_numel = -1;            // what it is cut to; -1: packed rows (cut_saved_packed)
  bool route_positions = false;      // a route's index, whose cut rewrites its values (routes.h)
  bool operator<(const CacheKey& o) const {
    return std::tie(data, numel, dtype, strides, sizes, padding_keys_zeroed, cut_numel, route_positions) <
           std::tie(o.data, o.numel, o.dtype, o.strides, o.sizes, o.padding_keys_zeroed, o.cut_numel,
                    o.route_positions);
  }
};

CacheKey key_of(const torch::Tensor& t, bool with_strides, bool padding_keys_zeroed, int64_t cut_numel,
                bool route_positions = false) {
  CacheKey key{t.data_ptr(), t.numel(),      static_cast<int>(t.scalar_type()), {}, {}, padding_keys_zeroed,
               cut_numel,    route_positions};
  if (with_strides) {
    key.strides = t.strides().vec();
    key.sizes = t.sizes().vec();
  }
  return key;
}

// Runs one cut (a copy of kept rows); COLLIDER_DEBUG_GATHER=1 prints it, to find slow copies.
template <typename Fn>
torch::Tensor timed_gather(const torch::Tensor& t, Fn&& fn) {
  if (!debug_gather()) return fn();
  const auto g0 = std::chrono::steady_clock::now();
  torch::Tensor out = fn();
  const double dt = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - g0).count();
  fmt::print(stderr, "collider gather {:7.2f} ms [{}] strides [{}] contiguous {} {} -> [{}]\n", dt,
             fmt::join(t.sizes(), ","), fmt::join(t.strides(), ","), t.is_contiguous(),
             std::string(c10::toString(t.scalar_type())), fmt::join(out.sizes(), ","));
  return out;
}

class Rewriter {
 public:
  // keep_sources: tensors behind saved-tensor hooks stay packed after their cut (validate).
  Rewriter(const PlanData& plan, std::shared_ptr<TokenIndex> index, bool cut_keys, bool masked, bool keep_sources,
           FilterStats& stats)
      : plan_(plan),
        ix_(std::move(index)),
        cut_keys_(cut_keys),
        masked_(masked),
        keep_sources_(keep_sources),
        stats_(stats) {}
  Rewriter(const Rewriter&) = delete;
  Rewriter& operator=(const Rewriter&) = delete;
  // Prepared and never written: our SavedVariables in the slots point at their SavedCut, which points
  // at the slot; the cycle is cut here.
  ~Rewriter() {
    if (!committed_)
      for (auto& slot : hooked_slots_) slot->reset_data();
  }

  // First pass: checks and computes everything, records the writes; the graph is untouched.
  void prepare(const Graph& g) {
    const auto& nodes = plan_.nodes;
    // Ragged masks: the token-row GEMMs that run on packed rows (none of them feeding another).
    std::vector<int> packed_output(nodes.size(), -1);
    if (ix_->ragged() && !masked_) {
      for (size_t i = 0; i < nodes.size(); ++i) packed_output[i] = packed_token_output(nodes[i]);
      for (size_t i = 0; i < nodes.size(); ++i) {
        if (packed_output[i] < 0) continue;
        for (const auto& e : g.nodes[i]->next_edges()) {
          auto it = e.function ? g.index.find(e.function.get()) : g.index.end();
          if (it != g.index.end() && packed_output[it->second] >= 0) packed_output[i] = -1;
        }
      }
    }
    // Ragged masks: eager attention cores run row by row (row_attention.h), their nodes replaced.
    std::vector<char> replaced(nodes.size(), 0);
    if (ix_->ragged() && !masked_) {
      for (size_t i = 0; i < nodes.size(); ++i)
        if (nodes[i].attention_core && nodes[i].type == "SoftmaxBackward0")
          row_attention(g, static_cast<int>(i), replaced);
    }
    for (size_t i = 0; i < nodes.size(); ++i) {
      if (replaced[i]) continue;
      if (nodes[i].fused_attention) {
        replace_fused(g, static_cast<int>(i));
        continue;
      }
      if (nodes[i].fields.empty()) continue;
      if (nodes[i].type == "torch::autograd::AccumulateGrad") {
        if (!masked_) full_rows_leaf(g, static_cast<int>(i));  // the masked method's gradients are full-size
        continue;
      }
      if (packed_output[i] >= 0) {
        pack_node(g, static_cast<int>(i), static_cast<size_t>(packed_output[i]));
        continue;
      }
      if (!masked_ && nodes[i].type == "IndexAddBackward0" && ix_->hooked_route(static_cast<int32_t>(i))) {
        replace_hooked_scatter(g, static_cast<int>(i));
        continue;
      }
      rewrite_node(g.nodes[i], nodes[i], static_cast<int>(i));
    }
    for (const auto& e : plan_.detached) detach(g, e);
  }
  // Second pass: the recorded writes (swaps with values computed in prepare()).
  void commit() {
    committed_ = true;
    for (auto& w : writes_) w();
    for (auto& [inner, node] : packed_) node->adopt_edges();
    for (auto& node : row_attention_) node->adopt_edges();
    for (auto& node : hooked_scatters_) node->adopt_edges();
  }
  // The graph as it was before commit() (the writes swapped back), for validate: the rewrite is
  // then discarded.
  void revert() {
    for (auto it = writes_.rbegin(); it != writes_.rend(); ++it) (*it)();
    for (auto& slot : hooked_slots_) slot->reset_data();  // our SavedVariables, which point at their SavedCut
    writes_.clear();
  }
  // The rewrite stays: the replaced nodes' tensors go, and so do the originals the writes hold.
  void finish() {
    for (auto& f : finals_) f();
    finals_.clear();
    writes_.clear();
  }
  // An edge into a GEMM that runs on packed rows leads to its PackedRowsNode instead.
  Edge redirect(const Edge& e) const {
    auto it = e.function ? packed_.find(e.function.get()) : packed_.end();
    return it == packed_.end() ? e : Edge(it->second, e.input_nr);
  }
  // A write of the commit pass: it swaps a field with the value it holds, so running it again
  // restores the field (revert()).
  void defer(std::function<void()> swap) { writes_.push_back(std::move(swap)); }
  // An edge whose gradient is zero by construction (plan_impl.h, DetachedEdge), removed.
  void detach(const Graph& g, const DetachedEdge& e) {
    const auto& node = g.nodes.at(e.node);
    if (plan_.nodes[e.node].type != node->name() || static_cast<size_t>(e.edge) >= node->num_outputs()) {
      throw Error(fmt::format("filter_backward: node #{} {} has no edge {} to detach (plan bug)", e.node, node->name(),
                              e.edge));
    }
    auto* edges = &const_cast<torch::autograd::edge_list&>(node->next_edges());  // as defer_edge (below)
    defer([edges, edge = e.edge, other = Edge()]() mutable { std::swap((*edges)[edge], other); });
  }
  // The two ways the rewrite splices the graph, each written in the commit pass (Node::set_next_edge
  // refuses nodes that already have parents, for topological_nr bookkeeping used only to prune
  // torch::autograd::grad with explicit inputs; the edge list itself is plain data, swapped).
  // replace_node: every edge into node i leads to `node` instead, at the same input number.
  void replace_node(const Graph& g, int i, const NodePtr& node) {
    for (const auto& [parent, edge] : g.parents[i]) {
      defer_edge(g.nodes[parent], edge, node, g.nodes[parent]->next_edge(edge).input_nr);
    }
  }
  // insert_on_edge: `node` (one input) on edge e of `parent`: it receives what the edge carried and
  // passes its result on along the old edge (to a GEMM's packed stand-in where there is one).
  void insert_on_edge(const NodePtr& parent, int e, const NodePtr& node) {
    node->add_next_edge(redirect(parent->next_edge(e)));
    defer_edge(parent, e, node, 0);
  }
  void defer_edge(const NodePtr& parent, int e, NodePtr node, uint32_t input_nr) {
    auto* edges = &const_cast<torch::autograd::edge_list&>(parent->next_edges());
    defer([edges, e, other = Edge(std::move(node), input_nr)]() mutable { std::swap((*edges)[e], other); });
  }
  // A SavedVariable swapped in for a saved tensor behind hooks: `slot` holds ours until commit()
  // and the original after it, where the SavedCut reads it (saved_cut.h).
  void defer_hooked(SavedVariable& v, std::shared_ptr<SavedVariable> slot) {
    hooked_slots_.push_back(slot);
    defer([&v, slot] { std::swap(v, *slot); });
  }

  // A leaf with token dimensions: every edge into its AccumulateGrad passes a FullRowsNode.
  void full_rows_leaf(const Graph& g, int i) {
    const FieldSpec* in = plan_.nodes[i].find(FieldKind::kInputMeta, 0);
    if (!in || !in->shape.has_token()) return;
    const auto& meta = g.nodes[i]->input_metadata(0);
    auto full = to_ints(meta.shape_as_dim_vector());
    auto bad = ix_->mismatch(full, in->shape);
    if (!bad.empty()) {
      throw Error(fmt::format("filter_backward: the leaf tensor of node #{} does not match the plan: {}", i, bad));
    }
    auto node = make_node<FullRowsNode>(ix_, in->shape, cut_keys_, full);
    node->add_input_metadata(meta.options(), to_syms(ix_->cut_sizes(full, in->shape, cut_keys_)), false, false,
                             std::nullopt);
    node->add_next_edge(Edge(g.nodes[i], 0));
    replace_node(g, i, node);  // an AccumulateGrad's one input is input 0
    ++stats_.nodes_rewritten;
  }

  // Fused attention: every edge into the SDPA node will lead to its filtered replacement.
  void replace_fused(const Graph& g, int i) {
    replace_node(g, i, make_filtered_attention(g.nodes[i], ix_, !cut_keys_, masked_));
    ++stats_.nodes_rewritten;
  }

  // The scatter of a mixture-of-experts route behind saved-tensor hooks (routes.h): replaced by a
  // node that takes the cut token rows and gives the route all its rows, a dropped token's zero.
  void replace_hooked_scatter(const Graph& g, int i) {
    const FieldSpec* in = plan_.nodes[i].find(FieldKind::kInputMeta, 0);
    const auto full = to_ints(g.nodes[i]->input_metadata(0).shape_as_dim_vector());
    const std::string bad = in ? ix_->mismatch(full, in->shape) : "no token rows";
    if (!bad.empty()) {
      throw Error(
          fmt::format("filter_backward: the graph does not match the plan at node #{} {}: {}. Re-trace the "
                      "plan for this model (collider::trace_plan).",
                      i, plan_.nodes[i].type, bad));
    }
    auto node = make_hooked_scatter(g.nodes[i], ix_, ix_->cut_sizes(full, in->shape, cut_keys_));
    replace_node(g, i, node);
    hooked_scatters_.push_back(std::move(node));
    ++stats_.nodes_rewritten;
  }

  // An eager attention core of a ragged mask, run row by row when the stand-in can replay it (else
  // its nodes are rewritten like any other, padded): every edge into P V leads to the stand-in,
  // the core's other nodes are left unreachable and their saved tensors released.
  void row_attention(const Graph& g, int softmax, std::vector<char>& replaced) {
    const AttentionCoreNodes core = locate_attention_core(g, plan_, softmax);
    std::string why;
    const auto t0 = std::chrono::steady_clock::now();
    auto node = make_row_attention(g, plan_, core, *ix_, ix_, !cut_keys_, &why);
    stats_.gather_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (!node) {
      if (debug_gather()) fmt::print(stderr, "collider: attention core at node #{} stays padded: {}\n", softmax, why);
      return;
    }
    std::vector<int> nodes = {core.softmax, core.qk, core.pv};
    nodes.insert(nodes.end(), core.down.begin(), core.down.end());
    nodes.insert(nodes.end(), core.up.begin(), core.up.end());
    for (int c : nodes) {
      replaced[c] = 1;
      finals_.push_back([n = g.nodes[c]] { n->release_variables(); });
    }
    replace_node(g, core.pv, node);
    for (const auto& row : node->rows()) {  // the cuts it made, in the gather statistics
      for (const auto* t : {&row.p, &row.r, &row.v, &row.q, &row.k_t}) {
        if (!t->defined() || (t == &row.r && row.r.is_same(row.p))) continue;
        ++stats_.tensors_gathered;
        stats_.bytes_gathered += static_cast<int64_t>(t->numel() * t->element_size());
      }
    }
    row_attention_.push_back(node);
    ++stats_.nodes_rewritten;
  }

  // What the rewrite writes in place of one saved tensor: the cut it unpacks to (made when the
  // backward first reads it, saved_cut.h) and the view of it this field wants.
  struct CutRef {
    std::shared_ptr<SavedCut> cut;
    std::vector<int64_t> view;  // empty: the cut as it is
  };

  // The kept tokens' rows of a [B*T, D] GEMM operand, packed to [S, D] (one gather per tensor).
  CutRef cut_saved_packed(const torch::Tensor& t) {
    CacheKey key = key_of(t, /*strides=*/true, false, -1);
    if (auto it = cache_.find(key); it != cache_.end()) return {it->second, {}};
    auto ix = ix_;
    auto cut = std::make_shared<SavedCut>(
        t, [ix](const torch::Tensor& x) { return timed_gather(x, [&] { return ix->cut_packed(x); }); });
    count_gather(t, ix_->kept_total() * (t.numel() / std::max<int64_t>(t.size(0), 1)));
    cache_[key] = cut;
    return {cut, {}};
  }

  // The cut of a saved tensor to the kept rows, or nothing when it has nothing to cut (keys under
  // exact_query). zero_padding_keys: the cut's padding keys are zeroed too, before it is shared
  // (softmax and P @ V save the same attention probabilities: one cut, zeroed once, serves both).
  std::optional<CutRef> cut_saved(const torch::Tensor& t, const ShapeSpec& spec, bool zero_padding_keys = false) {
    auto want = ix_->cut_sizes(t.sizes(), spec, cut_keys_);
    // (A route's index changes its values even where it keeps every row.)
    if (spec.pad_rank == 0 && !zero_padding_keys && c10::IntArrayRef(want) == t.sizes() && !spec.remaps_values())
      return std::nullopt;
    const int64_t want_numel = c10::multiply_integers(want);
    // One gather per distinct tensor: contiguous views of the same memory share it (each takes
    // its view of the contiguous cut); any other is shared only by its own sizes and strides.
    // Broadcast fields (pad_rank > 0) are cut apart.
    std::optional<CacheKey> key;
    if (spec.pad_rank == 0) key = key_of(t, !t.is_contiguous(), zero_padding_keys, want_numel, spec.remaps_values());
    if (key) {
      if (auto it = cache_.find(*key); it != cache_.end()) {
        return CutRef{it->second, t.is_contiguous() ? want : std::vector<int64_t>{}};
      }
    }
    auto cut = std::make_shared<SavedCut>(t, cut_fn(spec, zero_padding_keys, /*check=*/false));
    count_gather(t, want_numel);
    if (key) cache_[*key] = cut;
    return CutRef{cut, key && t.is_contiguous() ? want : std::vector<int64_t>{}};
  }

  // The cut a saved tensor gets (TokenIndex::cut, kept in the input's layout; see cut_saved).
  // check: compare its sizes with the plan first (tensors behind saved-tensor hooks, whose
  // sizes filter_backward cannot see).
  SavedCut::CutFn cut_fn(const ShapeSpec& spec, bool zero_padding_keys, bool check) const {
    auto ix = ix_;
    const bool cut_keys = cut_keys_;
    return [ix, spec, zero_padding_keys, cut_keys, check](const torch::Tensor& t) {
      if (check) {
        auto bad = ix->mismatch(t.sizes(), spec);
        TORCH_CHECK(bad.empty(),
                    "collider: a saved tensor unpacked through saved-tensor hooks does not match the plan (", bad,
                    "); re-trace the plan with the same checkpointing or offloading set-up");
      }
      auto want = ix->cut_sizes(t.sizes(), spec, cut_keys);
      if (spec.pad_rank == 0 && c10::IntArrayRef(want) == t.sizes() && !spec.remaps_values()) {
        return zero_padding_keys ? ix->zero_padding(t, spec, /*keys_only=*/true) : t;
      }
      return timed_gather(t, [&] {
        torch::Tensor out = ix->cut(t, spec, cut_keys);
        const auto st = out.strides();
        const bool broadcast = std::find(st.begin(), st.end(), 0) != st.end();  // expanded on purpose (TokenIndex::cut)
        // Dense results keep the input's layout (TokenIndex cuts permuted views in memory order). A
        // contiguous input stays contiguous: some backward kernels read saved tensors as flat arrays
        // (layer norm's mean and rstd), and a sequence-first [T, B, ..] cut comes back permuted.
        if (!broadcast && (!out.is_non_overlapping_and_dense() || (t.is_contiguous() && !out.is_contiguous()))) {
          out = out.contiguous();
        }
        if (zero_padding_keys) out = ix->zero_padding_into(out, t, spec, /*keys_only=*/true);
        return out;
      });
    };
  }

  // The masked method's kept_only oracle: attention probabilities restricted to kept rows and columns.
  SavedCut::CutFn zero_dropped_fn(const ShapeSpec& spec) const {
    auto ix = ix_;
    return [ix, spec](const torch::Tensor& t) { return t.is_floating_point() ? ix->zero_dropped(t, spec, true) : t; };
  }

  void count_hooked() { ++stats_.tensors_hooked; }
  // A distinct saved tensor to be cut to `cut_numel` elements (the copy is made in the backward).
  void count_gather(const torch::Tensor& t, int64_t cut_numel) {
    ++stats_.tensors_gathered;
    stats_.bytes_before += static_cast<int64_t>(t.numel() * t.element_size());
    stats_.bytes_gathered += static_cast<int64_t>(cut_numel * t.element_size());
  }

 private:
  class Apply;

  void rewrite_node(const NodePtr& node, const NodeSpec& spec, int index);
  void pack_node(const Graph& g, int index, size_t token_output);

  const PlanData& plan_;
  std::shared_ptr<TokenIndex> ix_;
  bool cut_keys_;
  bool masked_;
  bool keep_sources_;
  bool committed_ = false;
  FilterStats& stats_;
  std::map<CacheKey, std::shared_ptr<SavedCut>> cache_;  // cut_saved, cut_saved_packed
  std::vector<std::function<void()>> writes_;            // swaps (defer)
  std::vector<std::function<void()>> finals_;            // one-way, once the rewrite stays (finish)
  std::vector<std::shared_ptr<SavedVariable>> hooked_slots_;
  std::unordered_map<const Node*, NodePtrOf<PackedRowsNode>> packed_;  // original node -> its stand-in
  std::vector<NodePtrOf<RowAttentionNode>> row_attention_;             // eager cores run row by row
  std::vector<NodePtrOf<HookedScatterNode>> hooked_scatters_;          // hooked routes' scatters (routes.h)
};

// Applies one node's FieldSpecs through the generated field handlers.
class Rewriter::Apply final : public FieldVisitor {
 public:
  // packed: the node's token fields go to the S packed kept rows (PackedRowsNode), not B*N.
  Apply(Rewriter& rw, const NodePtr& node, const NodeSpec& spec, int index, bool packed = false)
      : rw_(rw), node_(node), spec_(spec), index_(index), packed_(packed) {}

  bool changed = false;

  void saved(const char* name, SavedVariable& v) override { on_saved(name, 0, v); }
  void saved_list(const char* name, std::vector<SavedVariable>& v) override {
    for (size_t i = 0; i < v.size(); ++i) on_saved(name, static_cast<int32_t>(i), v[i]);
  }
  void sizes(const char* name, std::vector<c10::SymInt>& v) override {
    const size_t len = std::strlen(name);
    if (is_strides_field(name)) {
      // Recompute as contiguous strides of the sibling sizes, when those were cut.
      if (cut_sizes_.empty()) return;
      auto it = cut_sizes_.find(std::string(name, len - 8) + "_sizes");
      if (it != cut_sizes_.end()) assign(v, to_syms(contiguous_strides(it->second)));
      return;
    }
    if (auto* f = find(name, 0, FieldKind::kSizes)) {
      auto out = apply_sizes(*f, to_ints(v));
      cut_sizes_[name] = out;
      assign(v, to_syms(out));
    }
  }
  void sizes_list(const char* name, std::vector<std::vector<c10::SymInt>>& v) override {
    for (size_t i = 0; i < v.size(); ++i)
      if (auto* f = find(name, static_cast<int32_t>(i), FieldKind::kSizes))
        assign(v[i], to_syms(apply_sizes(*f, to_ints(v[i]))));
  }
  void symint(const char*, c10::SymInt&) override {}
  // A slice's end along T + c key positions (attention sinks sliced off, [..., :T]): T -> N where
  // the keys are cut.
  void opt_symint(const char* name, std::optional<c10::SymInt>& v) override {
    const FieldSpec* f = v ? find(name, 0, FieldKind::kSizes) : nullptr;
    if (!f) return;
    auto out = apply_sizes(*f, {v->expect_int()});
    assign(v, std::optional<c10::SymInt>(c10::SymInt(out.at(0))));
  }
  void opt_sizes(const char* name, c10::OptionalArray<c10::SymInt>& v) override {
    if (!v.list) return;
    if (auto* f = find(name, 0, FieldKind::kSizes)) assign(*v.list, to_syms(apply_sizes(*f, to_ints(*v.list))));
  }
  void int_sizes(const char* name, std::vector<int64_t>& v) override {
    if (auto* f = find(name, 0, FieldKind::kSizes)) assign(v, apply_sizes(*f, v));
  }
  void type_and_size(const char* name, torch::autograd::generated::TypeAndSize& v) override {
    if (auto* f = find(name, 0, FieldKind::kSizes)) assign(v.sym_sizes, to_syms(apply_sizes(*f, to_ints(v.sym_sizes))));
  }
  void geometry(const char*, at::TensorGeometry&) override {}
  void int64(const char*, int64_t&) override {}

  // CopySlices: its two geometries, cut together (slices.h).
  void copy_slices(torch::autograd::CopySlices& cs) {
    const FieldSpec* base = find("slice:base", 0, FieldKind::kSizes);
    const FieldSpec* view = find("slice:view", 0, FieldKind::kSizes);
    if (!base || !view) return;
    if (auto why = copy_slices_unsupported(cs); !why.empty()) mismatch(*base, why);
    auto cut = cut_copy_slices(cs, apply_sizes(*base, to_ints(cs.base.sym_sizes())),
                               apply_sizes(*view, to_ints(cs.view.sym_sizes())));
    assign(cs.base, std::move(cut.first));
    assign(cs.view, std::move(cut.second));
  }

  void inputs() {
    for (const auto& f : spec_.fields) {
      if (f.kind != FieldKind::kInputMeta) continue;
      auto out = apply_sizes(f, to_ints(node_->input_metadata(f.item).shape_as_dim_vector()));
      Node* node = node_.get();
      const uint32_t item = static_cast<uint32_t>(f.item);
      rw_.defer([node, item, other = std::vector<c10::SymInt>(out.begin(), out.end())]() mutable {
        auto& shape = node->mutable_input_metadata(item).mutable_shape_as_dim_vector();
        std::vector<c10::SymInt> current(shape.begin(), shape.end());
        shape.assign(other.begin(), other.end());
        other = std::move(current);
      });
    }
  }

 private:
  static bool two_token_dims(const ShapeSpec& s) {
    int n = 0;
    for (const auto& d : s.dims) n += d.kind != DimKind::kBatch;
    return n >= 2;
  }
  // The field is written in the commit pass, from the value computed now (a swap: see defer).
  template <typename V>
  void assign(V& field, V value) {
    rw_.defer([&field, value = std::move(value)]() mutable { std::swap(field, value); });
  }
  const FieldSpec* find(const char* name, int32_t item, FieldKind kind) const { return spec_.find(kind, item, name); }
  [[noreturn]] void mismatch(const FieldSpec& f, const std::string& what) const {
    throw Error(
        fmt::format("filter_backward: the graph does not match the plan at node #{} {} field {}: {}. "
                    "Re-trace the plan for this model (collider::trace_plan).",
                    index_, spec_.type, f.name, what));
  }
  // A field of a mixture-of-experts route behind saved-tensor hooks, which keeps all its rows (routes.h).
  bool in_hooked_route(const FieldSpec& f) const {
    for (const auto& d : f.shape.dims)
      if (d.routed() && rw_.ix_->hooked_route(d.route)) return true;
    return false;
  }
  std::vector<int64_t> apply_sizes(const FieldSpec& f, const std::vector<int64_t>& values) {
    if (in_hooked_route(f)) return values;
    auto bad = rw_.ix_->mismatch(values, f.shape);
    if (!bad.empty()) mismatch(f, bad);
    if (rw_.masked_) return values;
    auto out = rw_.ix_->cut_sizes(values, f.shape, rw_.cut_keys_);
    if (packed_) out[0] = rw_.ix_->kept_total();  // [B*T, D] -> [S, D] (packed_token_output)
    if (out != values) changed = true;
    return out;
  }
  void on_saved(const char* name, int32_t item, SavedVariable& v) {
    const FieldSpec* f = find(name, item, FieldKind::kSaved);
    if (!f) return;
    if (in_hooked_route(*f)) {
      // The route keeps its rows; a gather's index turns into rows of the cut token rows, a dropped
      // token's into row 0, where its zero gradient adds nothing.
      if (rw_.masked_ || !f->shape.remaps_values()) return;
      auto ix = rw_.ix_;
      auto shape = f->shape;
      replace_saved(name, v, [ix, shape](const torch::Tensor& index) { return ix->hooked_route_values(index, shape); });
      return;
    }
    // The kept_only oracle of the masked method touches only the attention probabilities.
    const bool masked_probabilities = rw_.cut_keys_ && spec_.attention_core && f->shape.has_key();
    if (rw_.masked_ && !masked_probabilities) return;
    // Ragged masks: padding keys get no attention probability (kept_only), so they neither
    // give nor receive gradient; P is the field with a query and a key dimension.
    const bool zero_keys = !rw_.masked_ && rw_.cut_keys_ && rw_.ix_->ragged() && spec_.attention_core &&
                           f->shape.has_key() && two_token_dims(f->shape);
    if (v.has_hooks()) {
      if (f->shape.has_routed()) {
        throw Error(fmt::format(
            "filter_backward: node #{} {} saves a mixture-of-experts route's rows behind saved-tensor hooks "
            "(checkpointing or offloading), which collider does not filter yet; leave those layers unhooked or use "
            "method loss_only",
            index_, spec_.type));
      }
      // Behind saved-tensor hooks (checkpointing, offloading): the tensor exists only when the
      // backward unpacks it; its cut is decided now and made then (saved_cut.h).
      SavedCut::CutFn fn;
      if (rw_.masked_) {
        fn = rw_.zero_dropped_fn(f->shape);
      } else if (packed_) {
        auto ix = rw_.ix_;
        auto shape = f->shape;
        fn = [ix, shape](const torch::Tensor& t) {
          auto bad = ix->mismatch(t.sizes(), shape);
          TORCH_CHECK(bad.empty(),
                      "collider: a saved tensor unpacked through saved-tensor hooks does not match the plan (", bad,
                      "); re-trace the plan with the same checkpointing or offloading set-up");
          return ix->cut_packed(t);
        };
      } else {
        fn = rw_.cut_fn(f->shape, zero_keys, /*check=*/true);
      }
      cut_behind_hooks(v, std::move(fn));
      return;
    }
    torch::Tensor t = unpacked(name, v);
    if (!t.defined()) return;
    auto bad = rw_.ix_->mismatch(t.sizes(), f->shape);
    if (!bad.empty()) mismatch(*f, bad);
    if (f->shape.remaps_values() && !rw_.ix_->is_route_index(t, f->shape)) {
      mismatch(*f, "it gathers by another index than the one its mixture-of-experts route scatters back by");
    }
    t = t.detach();
    std::optional<CutRef> ref;
    if (rw_.masked_) {
      if (!t.is_floating_point()) return;
      ref = CutRef{std::make_shared<SavedCut>(t, rw_.zero_dropped_fn(f->shape)), {}};
    } else if (packed_) {
      ref = rw_.cut_saved_packed(t);
    } else {
      ref = rw_.cut_saved(t, f->shape, zero_keys);
    }
    if (!ref) return;  // nothing to cut (keys under exact_query)
    rw_.defer([&v, other = std::make_shared<SavedVariable>(saved_cut_variable(ref->cut, ref->view))] {
      std::swap(v, *other);
    });
    changed = true;
  }

  // A saved tensor not behind hooks, as the node holds it.
  torch::Tensor unpacked(const char* name, SavedVariable& v) const {
    try {
      return v.unpack(node_);
    } catch (const std::exception& e) {
      throw Error(
          fmt::format("filter_backward: cannot read saved tensor {} of node #{} {} ({}). Call "
                      "filter_backward once per loss, before loss.backward().",
                      name, index_, spec_.type, first_line(e.what())));
    }
  }
  // A saved tensor behind saved-tensor hooks: made by `fn` from what the hooks unpack, when the
  // backward first reads it (saved_cut.h).
  void cut_behind_hooks(SavedVariable& v, SavedCut::CutFn fn) {
    auto slot = std::make_shared<SavedVariable>();
    auto cut = std::make_shared<SavedCut>(WeakNodePtr(node_), slot, rw_.keep_sources_, std::move(fn));
    *slot = saved_cut_variable(cut);
    rw_.count_hooked();
    rw_.defer_hooked(v, slot);
    changed = true;
  }
  // A saved tensor replaced by `fn` of it, behind hooks or not.
  void replace_saved(const char* name, SavedVariable& v, SavedCut::CutFn fn) {
    if (v.has_hooks()) {
      cut_behind_hooks(v, std::move(fn));
      return;
    }
    torch::Tensor t = unpacked(name, v);
    if (!t.defined()) return;
    auto cut = std::make_shared<SavedCut>(t.detach(), std::move(fn));
    rw_.defer([&v, other = std::make_shared<SavedVariable>(saved_cut_variable(cut, {}))] { std::swap(v, *other); });
    changed = true;
  }

  Rewriter& rw_;
  const NodePtr& node_;
  const NodeSpec& spec_;
  int index_;
  bool packed_;
  std::map<std::string, std::vector<int64_t>> cut_sizes_;
};

void Rewriter::rewrite_node(const NodePtr& node, const NodeSpec& spec, int index) {
  Apply apply(*this, node, spec, index);
  if (const NodeFields* nf = find_node_fields(*node)) {
    nf->visit(node.get(), apply);
  } else if (auto* saved = custom_saved(*node)) {  // a Python custom Function trace_plan ran row for row
    apply.saved_list("ctx.saved_tensors", *saved);
  } else if (auto* cs = as_copy_slices(*node)) {  // x[..., :n].copy_(y) (slices.h)
    apply.copy_slices(*cs);
  }
  apply.inputs();
  if (apply.changed) ++stats_.nodes_rewritten;
}

// A token-row GEMM of a ragged mask: its fields cut to the packed rows, a PackedRowsNode put in
// its place (every edge into it leads to the stand-in; its input is the padded [B*N, Dout]).
void Rewriter::pack_node(const Graph& g, int i, size_t token_output) {
  const NodePtr& node = g.nodes[i];
  const NodeSpec& spec = plan_.nodes[i];
  Apply apply(*this, node, spec, i, /*packed=*/true);
  if (const NodeFields* nf = find_node_fields(*node)) nf->visit(node.get(), apply);
  apply.inputs();
  const FieldSpec* in = spec.find(FieldKind::kInputMeta, 0);
  if (!in || node->num_inputs() != 1) {
    throw Error(fmt::format("filter_backward: node #{} {} has no token-shaped input (plan bug)", i, spec.type));
  }
  const auto& meta = node->input_metadata(0);
  auto stand_in = make_node<PackedRowsNode>(node, token_output, ix_);
  stand_in->add_input_metadata(meta.options(),
                               to_syms(ix_->cut_sizes(to_ints(meta.shape_as_dim_vector()), in->shape, cut_keys_)),
                               false, false, std::nullopt);
  replace_node(g, i, stand_in);
  packed_[node.get()] = stand_in;
  ++stats_.nodes_rewritten;
  ++stats_.gemms_packed;
}

bool has_routes(const PlanData& plan) {
  for (const auto& ns : plan.nodes)
    for (const auto& f : ns.fields)
      if (f.shape.has_routed()) return true;
  return false;
}

// Why the graph is not the one `plan` was traced on (its first differing node), or empty.
std::string type_mismatch(const Graph& g, const std::vector<const std::string*>& types, const PlanData& plan,
                          const char* who) {
  const size_t n = std::min(g.nodes.size(), plan.nodes.size());
  for (size_t i = 0; i < n; ++i) {
    const std::string& t = *types[i];
    // The fused attention kernels are interchangeable: which one runs can depend on the mask, the
    // dtype or the device (CUDA's flash takes no mask, the memory-efficient one does).
    if (t != plan.nodes[i].type && !(plan.nodes[i].fused_attention && is_fused_attention_node(t))) {
      if (is_reentrant_checkpoint(t))
        return fmt::format("{}: node #{} is {}: {}", who, i, t, reentrant_checkpoint_advice());
      if (t == "ToCopyBackward0" || plan.nodes[i].type == "ToCopyBackward0") {  // a dtype cast where the trace had none
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
// ran those row for row; a plan read from text, or a node registered passthrough, skipped that).
void check_passthrough_nodes(const Graph& g, const PlanData& plan, const TokenIndex& ix, const char* who) {
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    if (plan.nodes[i].fields.empty() || find_node_fields(*g.nodes[i])) continue;
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

// Everything a rewrite writes, checked and computed, nothing written yet (Rewriter::commit).
std::unique_ptr<Rewriter> prepare_rewrite(const Graph& g, const PlanData& data, const std::shared_ptr<TokenIndex>& ix,
                                          bool exact, bool masked, bool keep_sources, FilterStats& stats,
                                          const char* who) {
  // exact_query: remember the key/value edges before their targets' shapes shrink.
  struct PendingInsert {
    const EdgeInsert* ins;
    Edge old_edge;
    at::TensorOptions options;
    std::vector<int64_t> shape;
  };
  std::vector<PendingInsert> pending;
  if (exact) {
    for (const auto& ins : data.inserts) {
      const auto& node = g.nodes[ins.node];
      Edge e = node->next_edge(ins.edge);
      if (!e.function) continue;  // K or V does not require grad
      const auto& meta = e.function->input_metadata(e.input_nr);
      pending.push_back({&ins, e, meta.options(), to_ints(meta.shape_as_dim_vector())});
    }
  }

  register_routes(g, data, *ix, who);
  auto rw = std::make_unique<Rewriter>(data, ix, /*cut_keys=*/!exact, masked, keep_sources, stats);
  rw->prepare(g);

  // Ragged masks: where token-shaped gradients are born, padding rows are zeroed.
  if (ix->ragged() && !masked) {
    auto token_input = [&](int node, uint32_t input_nr) -> const FieldSpec* {
      for (const auto& f : data.nodes[node].fields)
        if (f.kind == FieldKind::kInputMeta && f.item == static_cast<int32_t>(input_nr) && f.shape.has_token())
          return &f;
      return nullptr;
    };
    for (size_t i = 0; i < g.nodes.size(); ++i) {
      bool has_token_input = false;
      for (const auto& f : data.nodes[i].fields)
        has_token_input = has_token_input || (f.kind == FieldKind::kInputMeta && f.shape.has_token());
      if (has_token_input || data.nodes[i].fused_attention) continue;
      const auto& edges = g.nodes[i]->next_edges();
      for (size_t e = 0; e < edges.size(); ++e) {
        if (!edges[e].function) continue;
        const int c = g.index.at(edges[e].function.get());
        const FieldSpec* f = token_input(c, edges[e].input_nr);
        if (!f) continue;
        const auto& meta = edges[e].function->input_metadata(edges[e].input_nr);
        auto shape = ix->cut_sizes(to_ints(meta.shape_as_dim_vector()), f->shape, !exact);
        auto node = make_node<ZeroPaddingNode>(ix, f->shape);
        node->add_input_metadata(meta.options(), to_syms(shape), false, false, std::nullopt);
        rw->insert_on_edge(g.nodes[i], static_cast<int>(e), node);
      }
    }
  }

  for (auto& p : pending) {
    auto bad = ix->mismatch(p.shape, p.ins->shape);
    if (!bad.empty()) {
      throw Error(fmt::format("{}: the key/value gradient edge of node #{} does not match the plan: {}", who,
                              p.ins->node, bad));
    }
    auto node = make_node<KeyRowsNode>(ix, p.ins->shape, masked);
    node->add_input_metadata(p.options, to_syms(p.shape), false, false, std::nullopt);
    rw->insert_on_edge(g.nodes[p.ins->node], p.ins->edge, node);  // the edge is still p.old_edge
    ++stats.gather_nodes_inserted;
  }
  return rw;
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
torch::autograd::variable_list gradients_with(Rewriter& r, bool commit, bool keep, const torch::Tensor& loss,
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

// The largest difference of `got` from `want`, relative to want's largest entry (NaN counts as infinite).
double relative_difference(const torch::Tensor& want, const torch::Tensor& got) {
  torch::Tensor w = want.defined() ? want.to(torch::kDouble) : torch::zeros_like(got, torch::kDouble);
  torch::Tensor h = got.defined() ? got.to(torch::kDouble) : torch::zeros_like(w);
  const double scale = w.abs().max().item<double>();
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
                                 const std::shared_ptr<TokenIndex>& ix, bool exact, Rewriter& rw, double tol,
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
                             const std::shared_ptr<TokenIndex>& ix, bool exact, Rewriter& rw, const char* who) {
  torch::autograd::edge_list leaves;
  for (const auto& n : g.nodes)
    if (n->num_inputs() == 1 && n->next_edges().empty() && n->name() == "torch::autograd::AccumulateGrad")
      leaves.emplace_back(n, 0);
  FilterStats ref_stats;
  auto ref = prepare_rewrite(g, data, ix, exact, /*masked=*/true, /*keep_sources=*/true, ref_stats, who);
  const auto want = gradients_with(*ref, /*commit=*/true, /*keep=*/false, loss, leaves);
  const auto got = gradients_with(rw, /*commit=*/true, /*keep=*/true, loss, leaves);
  double worst = 0;
  size_t worst_leaf = 0;
  {
    torch::NoGradGuard no_grad;
    for (size_t k = 0; k < leaves.size(); ++k) {
      if (!want[k].defined() && !got[k].defined()) continue;
      const double rel = relative_difference(want[k], got[k]);
      if (rel > worst) worst = rel, worst_leaf = k;
    }
  }
  const auto dtype = loss.scalar_type();
  const double tol = dtype == torch::kDouble ? 1e-4 : dtype == torch::kFloat ? 1e-3 : 5e-2;
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

const char* to_string(AttentionGrad a) { return a == AttentionGrad::kKeptOnly ? "kept_only" : "exact_query"; }

AttentionGrad attention_grad_from_string(const std::string& s) {
  if (s == "kept_only") return AttentionGrad::kKeptOnly;
  if (s == "exact_query") return AttentionGrad::kExactQuery;
  throw std::invalid_argument("unknown attention_grad '" + s + "'; allowed: kept_only, exact_query");
}

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
