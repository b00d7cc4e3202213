// Pass (per field): a node outside ATen that is not a Python Function with visible saved tensors
// (a declared passthrough, a C++ node) may not save a token-shaped tensor: its backward would read
// it at full length, and registering the node does not make that safe.
#include "pass.h"

#include <collider/collider.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace collider::detail {

FieldVerdict refuse_passthrough_saves(NodeFacts& n, FieldFacts& f) {
  if (!n.a.generated && f.a.kind == FieldKind::kSaved) {
    throw Error(fmt::format(
        "collider cannot filter through node {} (#{}): declared passthrough, but it saves a token-shaped tensor "
        "([{}]), which its backward would read at full length; registering it does not make that safe. Write "
        "the op with torch operations",
        n.spec.type, n.i, fmt::join(f.a.values, ", ")));
  }
  return FieldVerdict::kNext;
}

}  // namespace collider::detail
