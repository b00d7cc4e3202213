// Pass (per node): a fused attention kernel (NodeTraits::fused_attention) is replaced whole at
// filter time (sdpa.h, the fused attention edit), which cuts its query rows and key columns as
// token positions: only where its query positions are the tokens. Marks it in the plan and ends
// the node (its fields are not the field cut's). One over positions of their own (a vision
// tower's image patches, a fixed memory) is an ordinary node with nothing token-shaped, left as it
// is. One from the tokens onto a sequence of one length in both traces (a cross-attention onto an
// encoder's source) is marked as such: its query rows cut, every key kept (token_rows.h marks one
// onto a source as long as the tokens). A cross-attention onto the tokens is refused.
#include "pass.h"

#include <collider/collider.h>

#include <fmt/format.h>

namespace collider::detail {

namespace {

enum class FusedSequence { kTokens, kOther, kCross, kMixed };

// Whether a fused attention node (a, b: its two observations) attends over the tokens: its query and
// key ([B, H, L, E]) both have L = T in both traces. kOther: no field of it has token positions;
// kCross: its queries do, and its keys and values are a sequence of one length in both traces (a
// cross-attention onto an encoder's source); kMixed: some have, otherwise (keys whose length follows T
// without being T: a prefix concatenated to the tokens' keys).
FusedSequence fused_attention_sequence(const ObservedNode& a, const ObservedNode& b, Sizes sa, Sizes sb) {
  bool tokens = false, query = false, key = false, fixed_key = false, fixed_value = false;
  for (size_t k = 0; k < a.fields.size(); ++k) {
    const Observed& x = a.fields[k];
    const Observed& y = b.fields[k];
    if (!x.defined || !y.defined || x.kind == FieldKind::kStrides || x.scalar) continue;
    const bool positions = x.values.size() >= 2 && y.values.size() == x.values.size() &&
                           x.values[x.values.size() - 2] == sa.T && y.values[y.values.size() - 2] == sb.T;
    query = query || (x.name == "query_" && positions);
    key = key || (x.name == "key_" && positions);
    const bool fixed = x.values.size() >= 2 && y.values.size() == x.values.size() &&
                       x.values[x.values.size() - 2] == y.values[y.values.size() - 2] &&
                       x.values[x.values.size() - 2] != sa.T;
    fixed_key = fixed_key || (x.name == "key_" && fixed);
    fixed_value = fixed_value || (x.name == "value_" && fixed);
    ShapeSpec spec;
    std::string why;
    tokens = tokens || !classify(x, y, sa, sb, spec, why) || spec.has_token();
  }
  if (query && key) return FusedSequence::kTokens;
  if (query && fixed_key && fixed_value) return FusedSequence::kCross;
  return tokens ? FusedSequence::kMixed : FusedSequence::kOther;
}

}  // namespace

NodeVerdict mark_fused_attention(NodeFacts& n) {
  if (n.traits.fused_attention == FusedAttention::kNone) return NodeVerdict::kNext;
  switch (fused_attention_sequence(n.a, n.b, n.trace.sa, n.trace.sb)) {
    case FusedSequence::kTokens:
      n.spec.fused_attention = true;
      return NodeVerdict::kDone;
    case FusedSequence::kCross:
      n.spec.fused_attention = n.spec.cross_attention = true;
      return NodeVerdict::kDone;
    case FusedSequence::kOther:
      return NodeVerdict::kDone;
    case FusedSequence::kMixed:
      throw Error(fmt::format(
          "collider cannot rewrite node {} (#{}): a fused attention onto the tokens from another sequence, or "
          "whose key positions follow the sequence length without being the tokens' (a prefix concatenated to the "
          "keys); use attn_implementation=\"eager\" for that module, or train it without token filtering",
          n.spec.type, n.i));
  }
  return NodeVerdict::kNext;
}

}  // namespace collider::detail
