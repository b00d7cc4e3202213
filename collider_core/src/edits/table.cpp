// The ordered table of the rewrite's edits, and the pass that runs it (edit.h). The order is the
// order of precedence: a node goes to the first edit that takes it, so the edits that replace a
// node or a whole attention core come before the field cut, which takes every node with
// token-shaped fields that is left. The edge edits come last: they read every node's input shape
// as the forward left it (nothing is written before commit) and insert on edges that may now lead
// to a stand-in (Transaction::redirect).
#include "edit.h"

namespace collider::detail {

namespace {

std::vector<std::unique_ptr<Edit>> make_table() {
  std::vector<std::unique_ptr<Edit>> table;
  table.push_back(make_run_whole_edit());  // before any edit that would cut its fields
  table.push_back(make_attention_rows_edit());  // takes whole eager cores under ragged masks
  table.push_back(make_fused_attention_edit());
  table.push_back(make_leaf_rows_edit());
  table.push_back(make_packed_rows_edit());
  table.push_back(make_route_scatters_edit());
  table.push_back(make_head_rows_edit());
  table.push_back(make_field_cut_edit());  // every node with token fields not taken above
  table.push_back(make_detach_edit());
  table.push_back(make_zero_padding_edit());
  table.push_back(make_key_rows_edit());
  return table;
}

}  // namespace

void run_edits(const Graph& g, Transaction& tx) {
  // One table per rewrite: an edit may keep what its before() found for its takes() and cut().
  const auto table = make_table();
  std::vector<char> taken(tx.plan().nodes.size(), 0);
  for (const auto& edit : table) edit->before(g, tx, taken);
  for (size_t i = 0; i < taken.size(); ++i) {
    if (taken[i]) continue;
    for (const auto& edit : table) {
      if (!edit->takes(g, static_cast<int>(i), tx)) continue;
      edit->cut(g, static_cast<int>(i), tx);
      break;
    }
  }
  for (const auto& edit : table) edit->after(g, tx);
}

}  // namespace collider::detail
