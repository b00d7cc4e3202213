// Pass (per field): an op that mixes or indexes positions along a dimension (NodeTraits::
// mixes_tokens) is refused when that dimension is a token one (classify.h: along_token_dim):
// filtering rows would change its result. Except a concatenation onto empty tensors (a KV cache's
// first step) and a provisional attention sink's op (sinks.cpp; check_sinks decides).
#include "pass.h"

#include <collider/collider.h>

#include <fmt/format.h>

namespace collider::detail {

FieldVerdict refuse_token_mixing(NodeFacts& n, FieldFacts& f) {
  if (n.traits.mixes_tokens && along_token_dim(n.a, f.a, f.spec) &&
      !is_cat_onto_empty(n.a, n.b, n.trace.sa, n.trace.sb) && !n.out.sink_ops.count(static_cast<int>(n.i))) {
    throw Error(
        fmt::format("collider cannot rewrite node {} (#{}): it mixes or indexes positions along a "
                    "token dimension (field {}); filtering rows would change its result{}",
                    n.spec.type, n.i, f.a.name, n.traits.mixing_hint));
  }
  return FieldVerdict::kNext;
}

}  // namespace collider::detail
