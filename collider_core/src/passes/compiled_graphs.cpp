// Pass (per field): refuses a torch.compile (AOTAutograd) graph with a token field: its saved
// activations live inside compiled code the rewriter cannot cut. Before the checks of custom
// Functions, which a compiled graph also looks like (no generated field handler).
#include "pass.h"

#include <collider/collider.h>

#include <fmt/format.h>

namespace collider::detail {

FieldVerdict refuse_compiled_graph(NodeFacts& n, FieldFacts&) {
  if (!n.a.generated && n.traits.compiled_graph) {
    throw Error(
        fmt::format("collider cannot rewrite node {} (#{}): it is a torch.compile (AOTAutograd) graph, "
                    "whose saved activations live inside compiled code the rewriter cannot cut. Trace "
                    "and filter the model and loss without torch.compile.",
                    n.spec.type, n.i));
  }
  return FieldVerdict::kNext;
}

}  // namespace collider::detail
