// Pass (per node): a fused attention kernel (NodeTraits::fused_attention) is replaced whole at
// filter time (sdpa.h, the fused attention edit), which cuts its query rows and key columns as
// token positions: only where its query positions are the tokens. Marks it in the plan and ends
// the node (its fields are not the field cut's). One over positions of their own (a vision
// tower's image patches, a fixed memory) is an ordinary node with nothing token-shaped, left as it
// is; a cross-attention onto the tokens is refused.
#include "pass.h"

#include <collider/collider.h>

#include <fmt/format.h>

namespace collider::detail {

namespace {

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

}  // namespace

NodeVerdict mark_fused_attention(NodeFacts& n) {
  if (n.traits.fused_attention == FusedAttention::kNone) return NodeVerdict::kNext;
  switch (fused_attention_sequence(n.a, n.b, n.trace.sa, n.trace.sb)) {
    case FusedSequence::kTokens:
      n.spec.fused_attention = true;
      return NodeVerdict::kDone;
    case FusedSequence::kOther:
      return NodeVerdict::kDone;
    case FusedSequence::kMixed:
      throw Error(fmt::format(
          "collider cannot rewrite node {} (#{}): a fused attention whose query and key positions are not both "
          "the tokens (a cross-attention); use attn_implementation=\"eager\" for that module, or train it "
          "without token filtering",
          n.spec.type, n.i));
  }
  return NodeVerdict::kNext;
}

}  // namespace collider::detail
