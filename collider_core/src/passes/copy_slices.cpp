// Pass (per field): an in-place write into a slice of a token-shaped tensor (CopySlices) keeps its
// input when slices.h cuts it; one it does not cut (observe.h describes it) is refused with what
// to write instead.
#include "pass.h"

#include <collider/collider.h>

#include <fmt/format.h>

namespace collider::detail {

FieldVerdict check_copy_slices(NodeFacts& n, FieldFacts& f) {
  if (!n.traits.copy_slices || f.a.kind != FieldKind::kInputMeta) return FieldVerdict::kNext;
  if (!n.a.described.empty()) {  // slices.h: the cases it cuts
    throw Error(
        fmt::format("collider cannot rewrite node {} (#{}): an in-place write into a slice of a token-shaped tensor "
                    "that collider does not cut ({}). Build the tensor with torch.cat",
                    n.spec.type, n.i, n.a.described));
  }
  return FieldVerdict::kKeep;
}

}  // namespace collider::detail
