// The attention-rows edit: under a ragged keep mask (sequences keeping different counts), an
// eager attention core (QK^T -> scale/mask -> softmax -> PV) is replaced by one stand-in that runs
// its backward one sequence at a time on that sequence's own kept count, instead of on
// [B, H, N, N] padded to the largest count (row_attention.h says what it replays and what it
// costs). Every edge into PV leads to the stand-in; the core's other nodes are left unreachable and
// their saved tensors released once the rewrite stays; the stand-in holds what it needs and cuts
// it, row by row, when its backward first runs. A core the stand-in cannot replay is left
// to the later edits, padded, with the same gradients. It runs before the node pass, so the core's
// nodes are taken from every other edit.
#include "edit.h"

#include "../attention_cores.h"

#include "../row_attention.h"

namespace collider::detail {
namespace {

class AttentionRowsEdit final : public Edit {
 public:
  const char* name() const override { return "attention rows"; }

  void before(const Graph& g, Transaction& tx, std::vector<char>& taken) override {
    if (!tx.index().ragged() || tx.masked()) return;
    const auto& nodes = tx.plan().nodes;
    for (size_t i = 0; i < nodes.size(); ++i)
      if (nodes[i].attention_core && traits_of(nodes[i].type).attention == AttentionRole::kSoftmax)
        replace_core(g, static_cast<int>(i), tx, taken);
  }

 private:
  static void replace_core(const Graph& g, int softmax, Transaction& tx, std::vector<char>& taken) {
    const AttentionCoreNodes core = locate_attention_core(g, tx.plan(), softmax);
    std::string why;
    FilterStats& stats = tx.stats();
    const auto t0 = std::chrono::steady_clock::now();
    auto node = make_row_attention(g, tx.plan(), core, tx.index(), tx.shared_index(), !tx.cut_keys(), &why);
    stats.gather_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (!node) {
      if (debug_gather()) fmt::print(stderr, "collider: attention core at node #{} stays padded: {}\n", softmax, why);
      return;
    }
    std::vector<int> nodes = {core.softmax, core.qk, core.pv};
    nodes.insert(nodes.end(), core.down.begin(), core.down.end());
    nodes.insert(nodes.end(), core.up.begin(), core.up.end());
    for (int c : nodes) {
      taken[c] = 1;
      tx.at_finish([n = g.nodes[c]] { n->release_variables(); });
    }
    tx.replace_node(g, core.pv, node);
    for (int64_t bytes : node->cut_bytes()) {  // the cuts its backward makes, in the gather statistics
      ++stats.tensors_gathered;
      stats.bytes_gathered += bytes;
    }
    tx.after_commit([node] { node->adopt_edges(); });
    ++stats.nodes_rewritten;
  }
};

}  // namespace

// The analysis step: the eager attention cores located structurally (attention_cores.h), for this
// edit, the key-rows edit (exact_query) and the field cut's attention sinks.
void attention_rows_cores(const TraceFacts& t, PlanData& plan) { find_attention_cores(t.ga, plan); }

std::unique_ptr<Edit> make_attention_rows_edit() { return std::make_unique<AttentionRowsEdit>(); }

}  // namespace collider::detail
