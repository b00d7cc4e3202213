// Internal: what a Plan records. For every node (in graph order) the fields that carry token
// dimensions, and for each such field which dimensions are token dimensions, which role they play
// inside attention (query rows vs key columns) and where the batch dimension sits, so the
// rewriter can cut the field to the kept rows without looking at sizes (it never guesses).
#pragma once

#include <collider/collider.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <vector>

namespace collider::detail {

enum class DimKind : uint8_t {
  kToken,         // size T
  kFlatToken,     // size B*mult*T, batch-major (row = (b*mult + j)*T + t); mult is 1 for [B*T, ..]
  kBatch,         // size B*mult, batch-major (row = b*mult + j)
  kFlatSeqFirst,  // size T*B*mult, token-major (row = t*B*mult + b*mult + j): a sequence-first
                  // [T, B*mult, ..] flattened (torch::nn's [T, B, D] layers)
  // Mixture-of-experts routes (routes.h): the rows of the tokens one expert received, a size that
  // depends on the data. A route's rows are those of the [B*T] token rows listed in its index.
  kRouted,           // size R: one row per routed token, in the route's order
  kRoutedPositions,  // the same rows, and the tensor's values are rows of [B*T] (the route's index)
  // Grouped experts (routes.h: one route per layer, its rows the [B*T*k] token-expert pairs sorted
  // by expert, k = mult experts per token):
  kRoutedSlots,    // the route's rows, and the values are rows of the [B*T*mult] token slots (t*mult + j)
  kRoutedOffsets,  // a fixed size (the experts); the values are the route's cumulative rows per expert
  kTokenSlots,     // size B*T*mult, a [B*T, mult] flattened (row = (b*T + t)*mult + j); the values are
                   // rows of the route (the sort's inverse permutation)
  // Attention sinks (GPT-OSS: cat(scores, sinks) along the keys): size T + mult, the T token
  // positions followed by mult fixed ones, which a cut keeps. Only inside a recognised attention
  // core (attention_cores.h).
  kTokenPlus,
  kFlatPerToken,  // size B*T*mult, position-major (row = (b*T + t)*mult + j): a [B, T, mult, ..]
                  // flattened, mult rows per token (a per-head norm over [B*T*H, D])
};

enum class Role : uint8_t {
  kQuery,  // an ordinary token dimension (also: attention's query rows); always cut
  kKey,    // attention's key/value columns; cut in kept_only, kept whole in exact_query
};

struct DimSpec {
  int32_t dim = 0;
  DimKind kind = DimKind::kToken;
  Role role = Role::kQuery;
  int64_t mult = 1;    // kBatch: size / B; the flat kinds: size / (B*T)
  int32_t route = -1;  // has_route(): the plan index of the node that sends the route's rows back to
                       // the token rows (IndexAddBackward0; grouped experts: IndexBackward0)

  bool flat() const {
    return kind == DimKind::kFlatToken || kind == DimKind::kFlatSeqFirst || kind == DimKind::kFlatPerToken;
  }
  // A dimension of a route's rows (its size R).
  bool routed() const {
    return kind == DimKind::kRouted || kind == DimKind::kRoutedPositions || kind == DimKind::kRoutedSlots;
  }
  // Tied to a route: its rows, or values that a cut of the route changes.
  bool has_route() const { return routed() || kind == DimKind::kRoutedOffsets || kind == DimKind::kTokenSlots; }
  // The tensor's values change under a cut (an index or offsets into cut rows), even where its sizes do not.
  bool remaps_values() const { return has_route() && kind != DimKind::kRouted; }
};

// How a tensor-shaped field maps to tokens. A tensor with token dimensions but no batch
// dimension (RoPE tables, causal masks) is broadcast: it is viewed at rank `pad_rank` (leading
// ones), its dimension `bcast_batch_dim` expanded to B*bcast_mult, then cut per sequence.
struct ShapeSpec {
  int32_t rank = 0;
  std::vector<DimSpec> dims;  // the dimensions that scale with B or T, in increasing order
  int32_t pad_rank = 0;       // > 0: broadcast tensor (see above)
  int32_t bcast_batch_dim = -1;
  int64_t bcast_mult = 1;

  bool has_token() const {
    for (const auto& d : dims)
      if (d.kind != DimKind::kBatch) return true;
    return false;
  }
  bool has_routed() const {
    for (const auto& d : dims)
      if (d.routed()) return true;
    return false;
  }
  bool remaps_values() const {
    for (const auto& d : dims)
      if (d.remaps_values()) return true;
    return false;
  }
  bool has_route() const {
    for (const auto& d : dims)
      if (d.has_route()) return true;
    return false;
  }
  bool has_key() const {
    for (const auto& d : dims)
      if (d.kind != DimKind::kBatch && d.role == Role::kKey) return true;
    return false;
  }
};

enum class FieldKind : uint8_t {
  kSaved,      // SavedVariable (item: index in a std::vector<SavedVariable>, else 0)
  kSizes,      // std::vector<c10::SymInt> / std::vector<int64_t> / TypeAndSize / OptionalArray
  kStrides,    // *_sym_strides: only observed while tracing, never stored; the rewrite
               // recomputes them as contiguous strides of the cut sibling sizes
  kInputMeta,  // the node's expected input shape number `item`
};

struct FieldSpec {
  std::string name;  // C++ field name in Functions.h, or "input" for input metadata
  FieldKind kind = FieldKind::kSaved;
  int32_t item = 0;
  ShapeSpec shape;
};

struct NodeSpec {
  std::string type;  // Node::name()
  bool attention_core = false;
  bool fused_attention = false;   // an SDPA backward node: replaced, not rewritten (sdpa.h)
  // with fused_attention: its keys and values are another sequence than the tokens (a cross-attention onto an
  // encoder's source, token_rows.h): its query rows are cut, its keys all kept
  bool cross_attention = false;
  // A node that cannot be cut row by row (it mixes or indexes positions along the tokens: a scan, a
  // short convolution, a slice or scatter along them, a custom Function that is not row to row): run
  // whole (edits/run_whole.cpp), its kept rows' gradient put back full-size, its backward at full size,
  // the gradients of its token-shaped inputs cut to the kept rows. Only its input metadata is kept.
  bool run_whole = false;
  std::vector<FieldSpec> fields;  // only fields with token dimensions

  // The field of this kind and item (and name, unless null); input metadata fields are named "input".
  const FieldSpec* find(FieldKind kind, int32_t item, const char* name = nullptr) const {
    for (const auto& f : fields)
      if (f.kind == kind && f.item == item && (!name || f.name == name)) return &f;
    return nullptr;
  }
};

// Marks ns to run whole (NodeSpec::run_whole): of its fields only its input metadata, the shapes of
// the gradients it receives, stays (and of `values`, the fields' trace values, the same entries).
inline void mark_run_whole(NodeSpec& ns, std::vector<std::vector<int64_t>>* values = nullptr) {
  ns.run_whole = true;
  size_t kept = 0;
  for (size_t j = 0; j < ns.fields.size(); ++j) {
    if (ns.fields[j].kind != FieldKind::kInputMeta) continue;
    ns.fields[kept] = ns.fields[j];
    if (values) (*values)[kept] = (*values)[j];
    ++kept;
  }
  ns.fields.resize(kept);
  if (values) values->resize(kept);
}

// exact_query: the gradient reaching a key/value input of an attention core carries all T
// key rows; a node inserted on that edge cuts it to the kept rows.
struct EdgeInsert {
  int32_t node = 0;  // the core matmul node
  int32_t edge = 0;  // its next_edge index (the K^T or V operand)
  ShapeSpec shape;   // of the gradient on that edge (full key rows)
};

// An edge whose gradient is zero by construction: the row maximum an attention core's scores are
// shifted by before the softmax (softmax(x - max x) does not depend on it). filter_backward removes
// it: after a kept_only cut of the key columns that gradient would no longer sum to zero.
struct DetachedEdge {
  int32_t node = 0;  // the subtraction (SubBackward0)
  int32_t edge = 0;  // its edge to the maximum
};

struct PlanData {
  int64_t batch_a = 0, seq_a = 0, batch_b = 0, seq_b = 0;  // the trace sizes
  std::vector<NodeSpec> nodes;
  // Per node, its next edges as plan indices (-1: an edge to no node). What lets a graph without
  // some mixture-of-experts routes be matched to the plan (routes.h); empty where a plan's text
  // form had none.
  std::vector<std::vector<int32_t>> children;
  std::vector<EdgeInsert> inserts;
  std::vector<DetachedEdge> detached;
  int64_t num_attention_cores = 0;
  // Nodes that could not be rewritten for exact_query (reason), e.g. an unrecognised softmax
  // over two token dimensions. Empty when exact_query is available.
  std::string exact_query_blocker;
};

}  // namespace collider::detail

// The traced variants of one loss: trace_plan makes two, one for batches of B > 1 and one for B = 1
// (whose graph can differ: reshapes of tensors with a size-1 batch dimension become views, and it
// needs no batch dimensions); Plan::merge adds those of other traces of the same model (with and
// without an attention mask, say, where transformers builds different graphs). filter_backward
// uses the first variant of the batch's kind whose node sequence is the graph's.
struct collider::Plan::Impl {
  std::vector<detail::PlanData> variants;
  // The check on first use (FilterOptions::check_every): the kinds of step already checked, as
  // (variant, its node count, exact_query, ragged), and the steps filtered with this plan. Copies of a
  // plan share it; a plan read from text starts a new one.
  struct CheckLog {
    std::mutex mutex;
    std::set<std::tuple<int64_t, int64_t, bool, bool>> checked;
    int64_t steps = 0;
  };
  std::shared_ptr<CheckLog> checks = std::make_shared<CheckLog>();
};
