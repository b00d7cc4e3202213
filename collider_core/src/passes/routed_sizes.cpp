// Pass (per field): a field taken as routed (a mixture-of-experts route, routes.h) may have one
// routed dimension and nothing else that scales with the batch: the route's cut replaces that one
// dimension's rows. Refuses a routed field with other batch or token dimensions.
#include "pass.h"

#include <collider/collider.h>

#include <fmt/format.h>

namespace collider::detail {

FieldVerdict refuse_routed_with_tokens(NodeFacts& n, FieldFacts& f) {
  if (f.spec.has_routed() && f.spec.dims.size() != 1) {  // one routed dimension, nothing else that scales
    throw Error(fmt::format("collider cannot rewrite node {} (#{}): field {} {}", n.spec.type, n.i, f.a.name, f.why));
  }
  return FieldVerdict::kNext;
}

}  // namespace collider::detail
