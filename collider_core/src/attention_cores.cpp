// Locating attention cores in a traced plan (see attention_cores.h): a softmax over a [.., Tq, Tk]
// score tensor between two batched matmuls, reached through shape and scale ops only.
#include "attention_cores.h"

#include "classify.h"
#include "node_traits.h"

#include <fmt/format.h>

#include <set>
#include <string>
#include <vector>

namespace collider::detail {

namespace {

// The node types come from the traits table (node_traits.h): softmax (and _safe_softmax, what
// scaled_dot_product_attention's math path runs under a mask), the matmuls (a biased one for Q K^T
// only), the shape and scale ops allowed between Q K^T and the softmax.
bool is_softmax(const std::string& t) { return traits_of(t).softmax(); }
bool is_bmm(const std::string& t) { return traits_of(t).attention == AttentionRole::kMatmul; }
bool is_qk_matmul(const std::string& t) { return traits_of(t).matmul(); }
bool is_key_operand(const std::string& type, const std::string& field) {
  return field.rfind(traits_of(type).key_operand(), 0) == 0;
}
bool is_shape_or_scale(const std::string& t) { return traits_of(t).score_op; }

bool is_sdpa(const std::string& t) { return t.rfind("ScaledDotProduct", 0) == 0 || t.rfind("Efficient", 0) == 0; }

// Attention sinks (GPT-OSS): the scores get c fixed columns appended (CatBackward0) before the
// softmax, which the probabilities lose again (SliceBackward0, [..., :T]); both have a field of
// T + c key positions (kTokenPlus; the field cut's check_sinks, edits/field_cut.cpp, checks how they cat and slice).
bool has_token_plus(const NodeSpec& ns) {
  for (const auto& f : ns.fields)
    for (const auto& d : f.shape.dims)
      if (d.kind == DimKind::kTokenPlus) return true;
  return false;
}
bool is_sink_op(const NodeSpec& ns) {
  const SinkRole sink = traits_of(ns.type).sink;
  return (sink == SinkRole::kCat || sink == SinkRole::kSlice) && has_token_plus(ns);
}

// The row maximum subtracted from the scores before the softmax (scores - scores.max(-1,
// keepdim=True).values, which GPT-OSS writes): node `sub` is SubBackward0 whose edge 1 is a
// MaxBackward0 of the tensor its edge 0 is. Returns that maximum's node, or -1.
int stabilising_max(const Graph& g, const PlanData& plan, int sub) {
  if (traits_of(plan.nodes[sub].type).sink != SinkRole::kSubtract) return -1;
  const auto& edges = g.nodes[sub]->next_edges();
  if (edges.size() != 2 || !edges[0].function || !edges[1].function) return -1;
  const int m = g.index.at(edges[1].function.get());
  if (traits_of(plan.nodes[m].type).sink != SinkRole::kMax) return -1;
  const auto& below = g.nodes[m]->next_edges();
  return below.size() == 1 && below[0].function == edges[0].function ? m : -1;
}

}  // namespace

AttentionCoreNodes locate_attention_core(const Graph& g, const PlanData& plan, int s) {
  auto type = [&](int i) -> const std::string& { return plan.nodes[i].type; };
  AttentionCoreNodes core;
  core.softmax = s;
  // Down (toward the inputs): the score chain to the QK^T matmul.
  int cur = s;
  for (int steps = 0; steps < 16; ++steps) {
    int next = -1;
    for (const auto& e : g.nodes[cur]->next_edges()) {
      if (e.function) {
        next = g.index.at(e.function.get());
        break;
      }
    }
    if (next < 0) break;
    if (is_qk_matmul(type(next))) {
      core.qk = next;
      break;
    }
    if (!is_shape_or_scale(type(next)) && !is_sink_op(plan.nodes[next])) break;
    core.down.push_back(next);
    cur = next;
  }
  // Up (toward the loss): the probability chain to the PV matmul (P is its first operand).
  cur = s;
  for (int steps = 0; steps < 16 && core.pv < 0; ++steps) {
    if (g.parents[cur].size() != 1) break;
    auto [p, edge] = g.parents[cur][0];
    if (is_bmm(type(p))) {
      if (edge == 0) core.pv = p;
      break;
    }
    if (!is_shape_or_scale(type(p)) && !is_sink_op(plan.nodes[p])) break;
    core.up.push_back(p);
    cur = p;
  }
  return core;
}

// Locates attention cores: softmax over a [.., Tq, Tk] score tensor, the batched matmul that
// made the scores (Q K^T) and the one that consumes the probabilities (P V).
void find_attention_cores(const Graph& g, PlanData& plan) {
  const int n = static_cast<int>(g.nodes.size());
  auto type = [&](int i) -> const std::string& { return plan.nodes[i].type; };
  auto two_token_field = [&](int i) {
    for (const auto& f : plan.nodes[i].fields)
      if (token_dims(f.shape).size() >= 2) return true;
    return false;
  };
  std::vector<std::string> problems;
  for (int s = 0; s < n; ++s) {
    if (!is_softmax(type(s)) || !two_token_field(s)) continue;
    const AttentionCoreNodes found = locate_attention_core(g, plan, s);
    const int qk = found.qk, pv = found.pv;
    if (qk < 0 || pv < 0) {
      problems.push_back(
          fmt::format("softmax node #{} over a [.., T, T] score tensor is not between two batched "
                      "matmuls (QK^T, PV) through shape/scale ops",
                      s));
      continue;
    }
    // A row maximum subtracted before the softmax carries a zero gradient (softmax(x - m) does not
    // depend on m); after a kept_only cut it would not sum to zero, so the edge to it is removed at
    // filter time and the maximum, which then never runs, is not rewritten.
    for (int d : found.down) {
      const int m = stabilising_max(g, plan, d);
      if (m < 0) continue;
      plan.detached.push_back(DetachedEdge{d, 1});
      plan.nodes[m].fields.clear();
    }
    std::vector<int> core = {s};
    core.insert(core.end(), found.down.begin(), found.down.end());
    core.insert(core.end(), found.up.begin(), found.up.end());
    core.push_back(qk);
    core.push_back(pv);
    for (int c : core) plan.nodes[c].attention_core = true;
    ++plan.num_attention_cores;
    // Roles: in core nodes a field with two token dims is [.., Tq, Tk]; in the matmuls the
    // second operand (mat2, baddbmm's batch2: K^T or V) is key-side.
    for (int c : core) {
      for (auto& f : plan.nodes[c].fields) {
        auto toks = token_dims(f.shape);
        const bool mat2 = is_key_operand(type(c), f.name);
        int seen = 0;
        for (auto& d : f.shape.dims) {
          if (d.kind != DimKind::kToken && d.kind != DimKind::kTokenPlus) continue;
          if (mat2 && (c == qk || c == pv))
            d.role = Role::kKey;
          else if (toks.size() >= 2 && seen == 1)
            d.role = Role::kKey;
          ++seen;
        }
      }
    }
    // Gradient edges into K^T (qk, edge 1; baddbmm's edge 2, after the bias) and V (pv, edge 1)
    // carry all key rows.
    for (int m : {qk, pv}) {
      const bool baddbmm = traits_of(type(m)).attention == AttentionRole::kBiasedMatmul;
      const FieldSpec* sizes = nullptr;
      for (const auto& f : plan.nodes[m].fields)
        if ((f.name == (baddbmm ? "batch2_" : "mat2_") || f.name == "mat2_sym_sizes") && !sizes) sizes = &f;
      if (!sizes) {
        problems.push_back(fmt::format("matmul node #{} has no token-shaped mat2 sizes", m));
        continue;
      }
      plan.inserts.push_back(EdgeInsert{m, baddbmm ? 2 : 1, sizes->shape});
    }
  }
  // Every two-token-dim field outside a recognised core, and every SDPA node, blocks exact_query.
  for (int i = 0; i < n; ++i) {
    if (plan.nodes[i].attention_core) continue;
    if (plan.nodes[i].fused_attention) continue;
    if (is_sdpa(type(i)) && !plan.nodes[i].fields.empty()) {  // (one over positions of its own has none)
      problems.push_back(fmt::format("node #{} {}: no filtered replacement for this fused attention", i, type(i)));
      continue;
    }
    for (const auto& f : plan.nodes[i].fields) {
      if (token_dims(f.shape).size() >= 2) {
        problems.push_back(
            fmt::format("node #{} {} field {} has two token dimensions outside a recognised "
                        "attention core",
                        i, type(i), f.name));
        break;
      }
    }
  }
  // The first problem and how many more: a model repeats the same core in every layer, and a
  // message listing each of them ran to thousands of characters.
  if (!problems.empty()) {
    plan.exact_query_blocker = problems.front();
    if (problems.size() > 1) plan.exact_query_blocker += fmt::format(" (and {} more)", problems.size() - 1);
    plan.exact_query_blocker += "; kept_only does not need the cores recognised";
  } else {
    plan.exact_query_blocker.clear();
  }
}

}  // namespace collider::detail
