// The head edit: Collider's fused LM head (head_node.h) knows which rows it kept and computes their
// gradient only; this edit tells it where the rest of the filtered backward expects them (the
// [B, N, D] or [B*N, D] rows of the cut, padding rows zero under a ragged mask), so the hidden
// states' gradient leaves the head already cut and no full-size zeros are built. The head's keep
// mask must be filter_backward's, on the hidden states' [B, T] rows: a head that kept other rows
// would put its gradient on the wrong ones, so a mismatch is refused. The oracle (masked) needs no
// write: the head's full-size gradient already holds zeros at the dropped rows.
#include "edit.h"

#include "../head_node.h"

namespace collider::detail {
namespace {

class HeadRowsEdit final : public Edit {
 public:
  const char* name() const override { return "head_rows"; }
  bool takes(const Graph& g, int i, const Transaction&) const override {
    return dynamic_cast<const FusedHeadNode*>(g.nodes[i].get()) != nullptr;
  }
  void cut(const Graph& g, int i, Transaction& tx) override {
    auto* head = static_cast<FusedHeadNode*>(g.nodes[i].get());
    TokenIndex& ix = tx.index();
    const int64_t B = ix.B(), T = ix.T(), N = ix.N();
    const auto& hs = head->hidden_sizes();
    const int64_t D = hs.back();
    const bool bt_rows = hs.size() == 3 && hs[0] == B && hs[1] == T;
    const bool flat_rows = hs.size() == 2 && hs[0] == B * T;
    if ((!bt_rows && !flat_rows) || head->keep().numel() != B * T) {
      throw Error(fmt::format("{}: the fused head's hidden states are [{}], not [B, T, D] or [B*T, D] rows of the "
                              "[{}, {}] keep mask; give the head hidden states laid out like the keep mask",
                              tx.who(), fmt::join(hs, ", "), B, T));
    }
    if (!head->keep().reshape({B, T}).equal(ix.keep_BT())) {
      throw Error(fmt::format("{}: the fused head was given another keep mask than this call; pass the same mask to "
                              "collider.fused_head_loss and to filter_backward",
                              tx.who()));
    }
    if (tx.masked()) return;
    FusedHeadNode::Layout cut;
    const torch::Tensor keep_BT = ix.keep_BT();
    const torch::Tensor rows_K = head->rows_K().to(keep_BT.device());
    if (ix.ragged()) {
      // The kept tokens' rows of [B*T] (ascending) and where the cut puts each (live rows of [B*N]).
      cut.slots_K = ix.live_rows().index_select(0, torch::searchsorted(ix.packed_rows(), rows_K));
    } else {  // row b's kept positions at b*N .. b*N + N - 1, in order
      const torch::Tensor slot_BT = keep_BT.to(torch::kLong).cumsum(1).sub_(1).add_(
          torch::arange(B, keep_BT.options().dtype(torch::kLong)).mul_(N).unsqueeze(1));
      cut.slots_K = slot_BT.reshape({-1}).index_select(0, rows_K);
    }
    cut.sizes = bt_rows ? std::vector<int64_t>{B, N, D} : std::vector<int64_t>{B * N, D};
    tx.defer([head, other = std::make_shared<FusedHeadNode::Layout>(std::move(cut))] {
      std::swap(head->layout(), *other);
    });
    ++tx.stats().nodes_rewritten;
  }
};

}  // namespace

std::unique_ptr<Edit> make_head_rows_edit() { return std::make_unique<HeadRowsEdit>(); }

}  // namespace collider::detail
