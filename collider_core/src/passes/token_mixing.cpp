// Pass (per field): an op that mixes or indexes positions along a dimension (NodeTraits::
// mixes_tokens: a cumulative sum, a convolution, a flip, a gather...) cannot be cut where that
// dimension is a token one (classify.h: along_token_dim): filtering rows would change its result.
// It is run whole instead (NodeSpec::run_whole, edits/run_whole.cpp). Except a concatenation onto
// empty tensors (a KV cache's first step) and a provisional attention sink's op (sinks.cpp;
// check_sinks decides), which are cut.
#include "pass.h"

namespace collider::detail {

FieldVerdict run_token_mixing_whole(NodeFacts& n, FieldFacts& f) {
  if (n.traits.mixes_tokens && along_token_dim(n.a, f.a, f.spec) &&
      !is_cat_onto_empty(n.a, n.b, n.trace.sa, n.trace.sb) && !n.out.sink_ops.count(static_cast<int>(n.i))) {
    n.spec.run_whole = true;  // its input metadata stays: the shapes of the gradients it receives
  }
  return FieldVerdict::kNext;
}

}  // namespace collider::detail
