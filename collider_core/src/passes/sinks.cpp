// Pass (per node): records the nodes that may be attention sinks' ops: a cat, slice or maximum
// along a dimension of T + c positions (c <= kMaxTokenPlus), what attention sinks look like
// (GPT-OSS: scores [.., T] and sinks [.., 1] concatenated, the row maximum subtracted, the sinks
// sliced off after the softmax). Such a node is taken provisionally (Classified::sink_ops): the
// scalar and token-mixing passes let it through, and the field cut's check_sinks
// (edits/field_cut.cpp) keeps it only inside an attention core.
#include "pass.h"

namespace collider::detail {

namespace {

// Whether node a (b: the same node in the other trace) acts along a dimension of T + c positions.
bool acts_along_token_plus_dim(const ObservedNode& a, const ObservedNode& b, Sizes sa, Sizes sb) {
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

}  // namespace

NodeVerdict record_sinks(NodeFacts& n) {
  const SinkRole sink = n.traits.sink;
  if (sink != SinkRole::kCat && sink != SinkRole::kSlice && sink != SinkRole::kMax) return NodeVerdict::kNext;
  if (acts_along_token_plus_dim(n.a, n.b, n.trace.sa, n.trace.sb)) n.out.sink_ops.insert(static_cast<int>(n.i));
  return NodeVerdict::kNext;
}

}  // namespace collider::detail
