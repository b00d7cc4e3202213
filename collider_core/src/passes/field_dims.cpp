// Pass (per field): classifies a field from its two observations (classify.h) into its token,
// batch and flattened dimensions, and drops what has none to cut: an undefined field, strides
// (recomputed from the sibling sizes when those are cut), one without token dimensions. A size
// that follows neither B nor T may be a mixture-of-experts route (routes.h): taken as routed here
// (Classified::candidates), refused by the routes pass unless a route claims it. A field whose
// sizes follow B or T in a way no edit can cut is refused.
#include "pass.h"

#include <collider/collider.h>

#include <fmt/format.h>

namespace collider::detail {

FieldVerdict classify_field(NodeFacts& n, FieldFacts& f) {
  const Observed& a = f.a;
  const Observed& b = f.b;
  if (!a.defined || !b.defined) return FieldVerdict::kSkip;
  if (a.kind == FieldKind::kStrides)
    return FieldVerdict::kSkip;  // recomputed from the sibling sizes when those are cut
  const Sizes sa = n.trace.sa, sb = n.trace.sb;
  if (!classify(a, b, sa, sb, f.spec, f.why) && classify(a, b, sa, sb, f.spec, f.why, /*allow_routed=*/true)) {
    n.out.candidates.push_back(RoutedCandidate{static_cast<int>(n.i), a.name, f.why});
  } else if (!f.why.empty()) {
    // Its saved fields, which help whoever extends the rewriter, only under COLLIDER_DEBUG_PLAN=1:
    // the message itself stays short enough to read (node, reason, what to do).
    // (A size that follows neither B nor T reaches here only with a rank that differs between
    // the traces; a routed one is assign_routes' to refuse, with its advice.)
    throw Error(fmt::format("collider cannot rewrite node {} (#{}): field {} {}.{}", n.spec.type, n.i, a.name, f.why,
                            debug_plan()
                                ? fmt::format(" Saved fields: {}", n.a.described.empty() ? "(none)" : n.a.described)
                                : std::string()));
  }
  if (!f.spec.has_token()) return FieldVerdict::kSkip;
  return FieldVerdict::kNext;
}

}  // namespace collider::detail
