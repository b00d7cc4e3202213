// Pass (per field): a TensorGeometry field (sizes, strides and offset saved together, as by
// as_strided) with token dimensions addresses storage, which no edit cuts: refused.
#include "pass.h"

#include <collider/collider.h>

#include <fmt/format.h>

namespace collider::detail {

FieldVerdict refuse_tensor_geometry(NodeFacts& n, FieldFacts& f) {
  if (f.a.name.rfind("geometry:", 0) == 0) {
    throw Error(
        fmt::format("collider cannot rewrite node {} (#{}): field {} (a TensorGeometry) has token "
                    "dimensions",
                    n.spec.type, n.i, f.a.name.substr(9)));
  }
  return FieldVerdict::kNext;
}

}  // namespace collider::detail
