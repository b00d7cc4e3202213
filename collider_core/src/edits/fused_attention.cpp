// The fused-attention edit: a scaled_dot_product_attention node (flash, memory-efficient, math,
// cuDNN: interchangeable, sdpa.h) saves whole [B, H, T, E] queries, keys and values that the
// generated field cut cannot slice inside the kernel. Every edge into it leads instead to a
// filtered attention backward (sdpa.h) that runs the kernel's backward on the kept query rows
// (kept_only: and kept keys; exact_query: every key, with dK/dV cut afterwards). A cross-attention
// onto another sequence (its keys an encoder's source, token_rows.h) keeps every key in both semantics:
// the kept queries' exact gradient, dK and dV whole.
#include "edit.h"

#include "../sdpa.h"

namespace collider::detail {
namespace {

class FusedAttentionEdit final : public Edit {
 public:
  const char* name() const override { return "fused attention"; }
  bool takes(const Graph&, int i, const Transaction& tx) const override { return tx.plan().nodes[i].fused_attention; }
  void cut(const Graph& g, int i, Transaction& tx) override {
    const bool cross = tx.plan().nodes[i].cross_attention;
    tx.replace_node(g, i,
                    make_filtered_attention(g.nodes[i], tx.shared_index(), cross || !tx.cut_keys(), tx.masked(), cross));
    ++tx.stats().nodes_rewritten;
  }
};

}  // namespace

std::unique_ptr<Edit> make_fused_attention_edit() { return std::make_unique<FusedAttentionEdit>(); }

}  // namespace collider::detail
