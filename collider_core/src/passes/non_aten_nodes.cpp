// Pass (per field): a node of C++ code outside ATen (a Python custom Function is checked by running
// it, python_functions.cpp) whose input has token dimensions is refused unless declared a
// passthrough: the contract (nothing token-shaped saved, gradient rows mapped one to one) is the
// user's to check, and the refusal says how to declare it.
#include "pass.h"

#include "../passthrough.h"

#include <collider/collider.h>

#include <fmt/format.h>

namespace collider::detail {

FieldVerdict refuse_non_aten_input(NodeFacts& n, FieldFacts& f) {
  if (!n.a.generated && f.a.kind == FieldKind::kInputMeta && !is_passthrough(n.spec.type) && !n.traits.leaf) {
    throw Error(fmt::format(
        "collider cannot rewrite node {} (#{}): not an ATen op, and its input has token dimensions. Only if "
        "it saves nothing token-shaped and its backward maps gradient rows one to one, "
        "collider.register_passthrough_node(\"{}\") declares it safe",
        n.spec.type, n.i, n.spec.type));
  }
  return FieldVerdict::kNext;
}

}  // namespace collider::detail
