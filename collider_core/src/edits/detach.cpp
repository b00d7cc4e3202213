// The detach edit: edges whose gradient is zero by construction (plan_impl.h, DetachedEdge: the
// row maximum an attention core's scores are shifted by before the softmax, on which
// softmax(x - max x) does not depend) are removed: after a kept_only cut of the key columns that
// gradient would no longer sum to zero.
#include "edit.h"

namespace collider::detail {
namespace {

class DetachEdit final : public Edit {
 public:
  const char* name() const override { return "detach"; }
  void after(const Graph& g, Transaction& tx) override {
    for (const auto& e : tx.plan().detached) {
      const auto& node = g.nodes.at(e.node);
      if (tx.plan().nodes[e.node].type != node->name() || static_cast<size_t>(e.edge) >= node->num_outputs()) {
        throw Error(fmt::format("filter_backward: node #{} {} has no edge {} to detach (plan bug)", e.node,
                                node->name(), e.edge));
      }
      tx.remove_edge(node, e.edge);
    }
  }
};

}  // namespace

std::unique_ptr<Edit> make_detach_edit() { return std::make_unique<DetachEdit>(); }

}  // namespace collider::detail
