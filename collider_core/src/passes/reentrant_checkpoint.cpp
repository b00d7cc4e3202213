// Pass (per node): refuses reentrant activation checkpointing's node (torch.utils.checkpoint with
// use_reentrant=True): it recomputes its block inside the backward, in a graph the plan never saw,
// so nothing in that block can be cut. The refusal says what to use instead (passthrough.h).
#include "pass.h"

#include "../passthrough.h"

#include <collider/collider.h>

#include <fmt/format.h>

namespace collider::detail {

NodeVerdict refuse_reentrant_checkpoint(NodeFacts& n) {
  if (n.traits.reentrant_checkpoint) {
    throw Error(fmt::format("collider cannot filter through node {} (#{}): {}", n.spec.type, n.i,
                            reentrant_checkpoint_advice()));
  }
  return NodeVerdict::kNext;
}

}  // namespace collider::detail
