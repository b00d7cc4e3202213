// Pass (per field): a scalar field equal to the sequence length is an index along the token
// dimension (a convolution's padding sliced off, x[..., :T]): the node runs whole
// (NodeSpec::run_whole, edits/run_whole.cpp). Except a divisor fixed by the forward (a mean's
// numel, dropped) and the end of the slice that cuts attention sinks off the key columns
// ([..., :T], kept as a key position for check_sinks, edits/field_cut.cpp).
#include "pass.h"

#include <collider/collider.h>

#include <fmt/format.h>

namespace collider::detail {

FieldVerdict check_scalar_field(NodeFacts& n, FieldFacts& f) {
  const Observed& a = f.a;
  if (!a.scalar) return FieldVerdict::kNext;
  if (a.name.find("numel") != std::string::npos) return FieldVerdict::kSkip;  // a divisor fixed by the forward (mean)
  if (n.out.sink_ops.count(static_cast<int>(n.i)) && n.traits.sink == SinkRole::kSlice && a.name == "end") {
    f.spec.dims[0].role = Role::kKey;  // the sinks sliced off the key columns: [..., :T] (check_sinks)
    return FieldVerdict::kKeep;
  }
  n.spec.run_whole = true;
  return FieldVerdict::kSkip;
}

}  // namespace collider::detail
