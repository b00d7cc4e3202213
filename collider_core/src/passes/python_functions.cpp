// Pass (per field): a Python custom Function (its saved tensors visible) is taken if its backward
// maps rows one to one, which check_python_functions (edits/field_cut.cpp) runs it to see once the
// fields are classified: its saved and input fields are kept and the node recorded
// (Classified::python_functions). A declared passthrough is not run (DDP's and FSDP2's queue work
// for the end of the backward).
#include "pass.h"

#include "../passthrough.h"

namespace collider::detail {

FieldVerdict record_python_function(NodeFacts& n, FieldFacts& f) {
  if (!n.a.generated && custom_saved(*n.trace.ga.nodes[n.i]) && !is_passthrough(n.spec.type) &&
      (f.a.kind == FieldKind::kSaved || f.a.kind == FieldKind::kInputMeta)) {
    n.out.python_functions.insert(static_cast<int>(n.i));
    return FieldVerdict::kKeep;
  }
  return FieldVerdict::kNext;
}

}  // namespace collider::detail
