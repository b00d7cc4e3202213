// Internal: the rewrite's transaction, the layer below every edit (edits/edit.h). An edit checks
// and computes everything in the prepare pass and records each graph write here as a swap
// (defer); nothing in the graph changes until commit() runs the swaps, which cannot fail. revert()
// runs them again (the graph as the forward left it, for validate), finish() lets the originals
// go once the rewrite stays. Besides the writes it holds the rewrite's vocabulary (replace a
// node, insert a node on an edge, remove an edge) and the gather cache: one cut per distinct
// saved tensor, made when the backward first reads it (saved_cut.h). It names no edit.
#pragma once

#include <collider/collider.h>

#include "graph.h"
#include "plan_impl.h"
#include "saved_cut.h"
#include "token_index.h"

#include <torch/csrc/autograd/function.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace collider::detail {

using torch::autograd::SavedVariable;

inline std::vector<c10::SymInt> to_syms(const std::vector<int64_t>& v) { return {v.begin(), v.end()}; }

// c10::Error's what() carries a C++ backtrace after the message; the message is its first line.
inline std::string first_line(const char* what) {
  std::string s(what);
  const auto nl = s.find('\n');
  return nl == std::string::npos ? s : s.substr(0, nl);
}

// COLLIDER_DEBUG_GATHER=1: one line per gather and the rewrite's phases (read once per process).
inline bool debug_gather() {
  static const bool on = std::getenv("COLLIDER_DEBUG_GATHER") != nullptr;
  return on;
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

class Transaction {
 public:
  // cut_keys: kept_only (keys cut with the queries); exact_query keeps every key. masked: the
  // oracle, full-size tensors. keep_sources: tensors behind saved-tensor hooks stay packed after
  // their cut (validate runs the backward more than once). who: the entry point, for messages.
  Transaction(const PlanData& plan, std::shared_ptr<TokenIndex> index, bool cut_keys, bool masked, bool keep_sources,
              FilterStats& stats, const char* who)
      : plan_(plan),
        ix_(std::move(index)),
        cut_keys_(cut_keys),
        masked_(masked),
        keep_sources_(keep_sources),
        stats_(stats),
        who_(who) {}
  Transaction(const Transaction&) = delete;
  Transaction& operator=(const Transaction&) = delete;
  ~Transaction();

  const PlanData& plan() const { return plan_; }
  TokenIndex& index() const { return *ix_; }
  const std::shared_ptr<TokenIndex>& shared_index() const { return ix_; }
  bool cut_keys() const { return cut_keys_; }
  bool masked() const { return masked_; }
  bool keep_sources() const { return keep_sources_; }
  FilterStats& stats() const { return stats_; }
  const char* who() const { return who_; }

  // The recorded writes (swaps with values computed in the prepare pass), then the stand-ins'
  // edges (after_commit).
  void commit();
  // The graph as it was before commit() (the writes swapped back), for validate: the rewrite is
  // then discarded.
  void revert();
  // The rewrite stays: the replaced nodes' tensors go, and so do the originals the writes hold.
  void finish();

  // A write of the commit pass: it swaps a field with the value it holds, so running it again
  // restores the field (revert()).
  void defer(std::function<void()> swap) { writes_.push_back(std::move(swap)); }
  // Run once the writes are in (a stand-in taking its original's edges, which other writes change).
  void after_commit(std::function<void()> f) { adopts_.push_back(std::move(f)); }
  // Run once the rewrite stays (finish), never after a revert.
  void at_finish(std::function<void()> f) { finals_.push_back(std::move(f)); }

  // The ways the rewrite splices the graph, each written in the commit pass (Node::set_next_edge
  // refuses nodes that already have parents, for topological_nr bookkeeping used only to prune
  // torch::autograd::grad with explicit inputs; the edge list itself is plain data, swapped).
  // replace_node: every edge into node i leads to `node` instead, at the same input number.
  void replace_node(const Graph& g, int i, const NodePtr& node);
  // insert_on_edge: `node` (one input) on edge e of `parent`: it receives what the edge carried and
  // passes its result on along the old edge (to a stand-in where there is one).
  void insert_on_edge(const NodePtr& parent, int e, const NodePtr& node);
  // remove_edge: edge e of `node` leads nowhere (its gradient is zero by construction).
  void remove_edge(const NodePtr& node, int e) { defer_edge(node, e, NodePtr(), 0); }
  // A node that stands in for `original` and calls it (PackedRowsNode): an edge inserted on the
  // way to the original leads to the stand-in instead (redirect).
  void stand_in(const torch::autograd::Node* original, NodePtr node) { stand_ins_[original] = std::move(node); }
  torch::autograd::Edge redirect(const torch::autograd::Edge& e) const;
  // A SavedVariable swapped in for a saved tensor behind hooks: `slot` holds ours until commit()
  // and the original after it, where the SavedCut reads it (saved_cut.h).
  void defer_hooked(SavedVariable& v, std::shared_ptr<SavedVariable> slot);

  // What the rewrite writes in place of one saved tensor: the cut it unpacks to (made when the
  // backward first reads it, saved_cut.h) and the view of it this field wants.
  struct CutRef {
    std::shared_ptr<SavedCut> cut;
    std::vector<int64_t> view;  // empty: the cut as it is
  };
  // The kept tokens' rows of a [B*T, D] GEMM operand, packed to [S, D] (one gather per tensor).
  CutRef cut_saved_packed(const torch::Tensor& t);
  // The cut of a saved tensor to the kept rows, or nothing when it has nothing to cut (keys under
  // exact_query). zero_padding_keys: the cut's padding keys are zeroed too, before it is shared
  // (softmax and P @ V save the same attention probabilities: one cut, zeroed once, serves both).
  std::optional<CutRef> cut_saved(const torch::Tensor& t, const ShapeSpec& spec, bool zero_padding_keys = false);
  // The cut a saved tensor gets (TokenIndex::cut, kept in the input's layout; see cut_saved).
  // check: compare its sizes with the plan first (tensors behind saved-tensor hooks, whose
  // sizes filter_backward cannot see).
  SavedCut::CutFn cut_fn(const ShapeSpec& spec, bool zero_padding_keys, bool check) const;
  // The packed kept rows of a GEMM operand behind saved-tensor hooks (cut_saved_packed's cut),
  // its sizes checked against the plan first.
  SavedCut::CutFn packed_cut_fn(const ShapeSpec& spec) const;
  // The masked method's kept_only oracle: attention probabilities restricted to kept rows and columns.
  SavedCut::CutFn zero_dropped_fn(const ShapeSpec& spec) const;

  void count_hooked() { ++stats_.tensors_hooked; }
  // A distinct saved tensor to be cut to `cut_numel` elements (the copy is made in the backward).
  void count_gather(const torch::Tensor& t, int64_t cut_numel);

 private:
  // Edge e of `parent` leads to `node` (input input_nr) once committed.
  void defer_edge(const NodePtr& parent, int e, NodePtr node, uint32_t input_nr);

  const PlanData& plan_;
  std::shared_ptr<TokenIndex> ix_;
  bool cut_keys_;
  bool masked_;
  bool keep_sources_;
  bool committed_ = false;
  FilterStats& stats_;
  const char* who_;
  std::map<CacheKey, std::shared_ptr<SavedCut>> cache_;  // cut_saved, cut_saved_packed
  std::vector<std::function<void()>> writes_;            // swaps (defer)
  std::vector<std::function<void()>> adopts_;            // after the writes (after_commit)
  std::vector<std::function<void()>> finals_;            // one-way, once the rewrite stays (finish)
  std::vector<std::shared_ptr<SavedVariable>> hooked_slots_;
  std::unordered_map<const torch::autograd::Node*, NodePtr> stand_ins_;  // original node -> its stand-in
};

}  // namespace collider::detail
