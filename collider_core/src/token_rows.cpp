// Which token-sized dimensions hold the tokens, from the data flow (see token_rows.h). Rows are followed
// along the edges whose gradient carries token-sized rows (the child's input has a token dimension): a
// node's rows are its parent's, so both are joined into one sequence (union-find), except on an
// attention's key and value edges, which join the attention's own key sequence. A self-attention's key
// sequence meets the tokens where its keys and queries come from the same hidden states; a
// cross-attention's (an encoder's output, only ever read as keys and values) never does.
#include "token_rows.h"

#include "attention_cores.h"
#include "node_traits.h"

#include <collider/error.h>

#include <fmt/format.h>

#include <algorithm>
#include <deque>
#include <map>
#include <numeric>
#include <string>
#include <vector>

namespace collider::detail {

namespace {

struct Sequences {
  std::vector<int> parent;
  explicit Sequences(size_t n) : parent(n) { std::iota(parent.begin(), parent.end(), 0); }
  int find(int x) {
    while (parent[x] != x) x = parent[x] = parent[parent[x]];
    return x;
  }
  void join(int a, int b) { parent[find(a)] = find(b); }
};

bool node_has_token_field(const NodeSpec& ns) {
  for (const auto& f : ns.fields)
    if (f.shape.has_token()) return true;
  return false;
}

// One attention: an eager core (its nodes, the QK^T and PV matmuls), a fused attention node, or a batched
// matmul of two token-shaped operands outside a recognised core (an attention collider does not recognise).
struct Attention {
  AttentionCoreNodes core;  // eager; core.softmax < 0 for the others
  int fused = -1;
  int bmm = -1;
  std::vector<int> nodes() const {
    if (fused >= 0) return {fused};
    if (bmm >= 0) return {bmm};
    std::vector<int> all = {core.softmax, core.qk, core.pv};
    all.insert(all.end(), core.down.begin(), core.down.end());
    all.insert(all.end(), core.up.begin(), core.up.end());
    return all;
  }
  int anchor() const { return fused >= 0 ? fused : bmm >= 0 ? bmm : core.pv; }
};

// What makes such a model's plan: the encoder's positions then differ from the tokens' by size, and an
// attention onto them keeps all its key columns (exact), as it does here.
constexpr const char* kOtherLength =
    "Give the source, in the loss function trace_plan calls, a fixed length (not the seq_len it passes), or "
    "train that model without token filtering";

bool is_attention_matmul(const std::string& t) { return traits_of(t).matmul(); }
const char* key_operand(const std::string& t) { return traits_of(t).key_operand(); }

// The key and value edges of attention `a`, as (node, edge index).
std::vector<std::pair<int, int>> key_edges(const Attention& a, const PlanData& plan) {
  if (a.fused >= 0) return {{a.fused, 1}, {a.fused, 2}};
  if (a.bmm >= 0) return {{a.bmm, traits_of(plan.nodes[a.bmm].type).query_edge() + 1}};
  return {{a.core.qk, traits_of(plan.nodes[a.core.qk].type).query_edge() + 1}, {a.core.pv, 1}};
}

// An eager core no longer counted as one: its key-row inserts (exact_query) go with it.
void drop_core(PlanData& plan, const Attention& a) {
  std::vector<EdgeInsert> inserts;
  for (const auto& ins : plan.inserts)
    if (ins.node != a.core.qk && ins.node != a.core.pv) inserts.push_back(ins);
  plan.inserts = inserts;
  --plan.num_attention_cores;
}

// A core from the tokens to another sequence: its key dimensions are no token dimensions. In its score
// chain a field is [.., Tq, Tk] (or a broadcast of it): the query rows at rank - 2 stay, the key columns at
// rank - 1 go; the key operands of the matmuls (K^T, V) lose every token dimension.
void keep_query_rows_only(PlanData& plan, const Attention& a) {
  for (int c : a.nodes()) {
    NodeSpec& ns = plan.nodes[c];
    std::vector<FieldSpec> kept;
    for (FieldSpec f : ns.fields) {
      const bool key_field = (c == a.core.qk || c == a.core.pv) && f.kind != FieldKind::kInputMeta &&
                             f.name.rfind(key_operand(ns.type), 0) == 0;
      std::vector<DimSpec> dims;
      for (const DimSpec& d : f.shape.dims) {
        if (d.kind == DimKind::kBatch) {
          dims.push_back(d);
          continue;
        }
        if (key_field || d.dim == f.shape.rank - 1) continue;
        if (d.kind != DimKind::kToken || d.dim != f.shape.rank - 2) {
          throw Error(fmt::format(
              "collider cannot rewrite node {} (#{}): an attention from the tokens to another sequence (a "
              "cross-attention onto an encoder's source) whose field {} has its positions in a layout collider "
              "does not cut. {}",
              ns.type, c, f.name, kOtherLength));
        }
        DimSpec q = d;
        q.role = Role::kQuery;
        dims.push_back(q);
      }
      f.shape.dims = dims;
      if (f.shape.has_token()) kept.push_back(f);
    }
    ns.fields = kept;
    ns.attention_core = false;
  }
  drop_core(plan, a);
}

}  // namespace

void separate_sequences(const Graph& g, PlanData& plan) {
  const int n = static_cast<int>(plan.nodes.size());
  std::vector<Attention> attentions;
  for (int s = 0; s < n; ++s) {
    const NodeSpec& ns = plan.nodes[s];
    if (ns.fused_attention && !ns.cross_attention) attentions.push_back(Attention{{}, s});  // cross: by its sizes
    if (!ns.attention_core || !traits_of(ns.type).softmax()) continue;
    Attention a;
    a.core = locate_attention_core(g, plan, s);
    if (a.core.qk >= 0 && a.core.pv >= 0) attentions.push_back(a);
  }
  std::vector<char> in_core(n, 0);
  for (const auto& a : attentions)
    for (int c : a.nodes()) in_core[c] = 1;
  for (int i = 0; i < n; ++i) {
    if (in_core[i] || !is_attention_matmul(plan.nodes[i].type)) continue;
    for (const auto& f : plan.nodes[i].fields) {
      if (f.kind != FieldKind::kSaved || f.name.rfind(key_operand(plan.nodes[i].type), 0) != 0) continue;
      if (f.shape.has_token()) attentions.push_back(Attention{{}, -1, i});
      break;
    }
  }
  std::map<std::pair<int, int>, int> key_edge;  // (node, edge) -> attention
  for (size_t k = 0; k < attentions.size(); ++k)
    for (const auto& e : key_edges(attentions[k], plan)) key_edge[e] = static_cast<int>(k);

  // One set per node, and one per attention's key sequence (n + k).
  Sequences seq(n + attentions.size());
  // A fused attention over the tokens records no fields (its replacement cuts it whole): its output rows
  // are its query rows.
  auto row_edge = [&](const torch::autograd::Edge& e) {
    if (!e.function) return false;
    const NodeSpec& c = plan.nodes[g.index.at(e.function.get())];
    const FieldSpec* in = c.find(FieldKind::kInputMeta, static_cast<int32_t>(e.input_nr));
    return c.fused_attention || (in && in->shape.has_token());
  };
  for (int i = 0; i < n; ++i) {
    const auto& edges = g.nodes[i]->next_edges();
    for (size_t k = 0; k < edges.size(); ++k) {
      if (!row_edge(edges[k])) continue;
      const int child = g.index.at(edges[k].function.get());
      auto it = key_edge.find({i, static_cast<int>(k)});
      seq.join(child, it == key_edge.end() ? i : n + it->second);
    }
  }
  // The tokens: the rows the loss is made of, where the nodes reached from the loss by edges that carry no
  // rows (its reduction, a sum of losses) meet token-sized rows.
  int tokens = -1;
  std::vector<char> seen(n, 0);
  std::deque<int> queue = {0};
  seen[0] = 1;
  while (!queue.empty()) {
    const int v = queue.front();
    queue.pop_front();
    bool rows = node_has_token_field(plan.nodes[v]);
    for (const auto& e : g.nodes[v]->next_edges()) {
      if (row_edge(e)) {
        rows = true;
        continue;
      }
      if (!e.function) continue;
      const int c = g.index.at(e.function.get());
      if (!seen[c]) seen[c] = 1, queue.push_back(c);
    }
    if (!rows) continue;
    if (tokens < 0) tokens = v;
    seq.join(v, tokens);
  }
  if (tokens < 0) return;
  tokens = seq.find(tokens);

  // The other sequences: those an attention's keys come from, that the tokens' rows never meet, and that
  // have an attention of their own (an encoder's layers), or are the keys of an attention inside one. That
  // the rows do not meet is not enough: where the hidden states need no gradient (frozen embeddings under
  // LoRA), a first layer's key and value projections meet its queries in no node of the graph.
  const int num_sets = n + static_cast<int>(attentions.size());
  std::vector<char> other(num_sets, 0), own_attention(num_sets, 0);
  std::vector<int> nodes_in(num_sets, 0);
  for (int i = 0; i < n; ++i) ++nodes_in[seq.find(i)];
  for (const auto& a : attentions) own_attention[seq.find(a.anchor())] = 1;
  for (bool grew = true; grew;) {
    grew = false;
    for (size_t k = 0; k < attentions.size(); ++k) {
      const int s = seq.find(n + static_cast<int>(k));
      if (s == tokens || other[s] || !(own_attention[s] || other[seq.find(attentions[k].anchor())])) continue;
      other[s] = 1;
      grew = true;
    }
  }
  // An attention from the tokens whose keys and values need no gradient: nothing in the graph says whether
  // they are the tokens or another sequence of the same length (a frozen encoder's).
  for (size_t k = 0; k < attentions.size(); ++k) {
    const Attention& a = attentions[k];
    if (a.bmm >= 0 || nodes_in[seq.find(n + static_cast<int>(k))] > 0 || seq.find(a.anchor()) != tokens) continue;
    throw Error(fmt::format(
        "collider cannot rewrite node {} (#{}): the keys and values of this attention need no gradient, so the "
        "graph does not show whether they are the tokens (a self-attention) or another sequence of the same "
        "length (a frozen encoder's source). If they are another sequence, give it, in the loss function "
        "trace_plan calls, a fixed length (not the seq_len it passes); if they are the tokens, let the key or "
        "value projection train, or train that model without token filtering",
        plan.nodes[a.anchor()].type, a.anchor()));
  }
  std::vector<char> cleared(n, 0);
  for (int i = 0; i < n; ++i) {
    // (a fused attention records no fields: one over the other sequence, an encoder's SDPA, is cleared too)
    if (!other[seq.find(i)] || (plan.nodes[i].fields.empty() && !plan.nodes[i].fused_attention)) continue;
    plan.nodes[i].fields.clear();  // another sequence's rows: all kept, never cut
    plan.nodes[i].fused_attention = plan.nodes[i].cross_attention = false;
    plan.nodes[i].attention_core = false;
    cleared[i] = 1;
  }
  for (size_t k = 0; k < attentions.size(); ++k) {
    const Attention& a = attentions[k];
    if (cleared[a.anchor()]) {  // an attention inside the other sequence (an encoder's self-attention)
      if (a.fused < 0 && a.bmm < 0) {
        for (int c : a.nodes()) plan.nodes[c].fields.clear(), plan.nodes[c].attention_core = false;
        drop_core(plan, a);
      }
      continue;
    }
    // From the tokens to another sequence: a cross-attention. (Keys that only do not meet the tokens' rows
    // stay the tokens' keys, as traced.)
    if (!other[seq.find(n + static_cast<int>(k))] || seq.find(a.anchor()) != tokens) continue;
    if (a.bmm >= 0) {
      throw Error(
          fmt::format("collider cannot rewrite node {} (#{}): a batched matmul from the tokens to another sequence (a "
                      "cross-attention onto an encoder's source) outside an attention core collider recognises. {}",
                      plan.nodes[a.bmm].type, a.bmm, kOtherLength));
    }
    if (a.fused >= 0) {  // its query rows cut, every key kept (sdpa.h)
      plan.nodes[a.fused].cross_attention = true;
      continue;
    }
    // Its scores may take no gradient from outside the core but through Q and K (a bias learned over both
    // sequences would be cut along the source's positions).
    const std::vector<int> nodes = a.nodes();
    const int query_edge = traits_of(plan.nodes[a.core.qk].type).query_edge();  // (edge 0: baddbmm's bias)
    for (int c : nodes) {
      const auto& edges = g.nodes[c]->next_edges();
      for (size_t e = 0; e < edges.size(); ++e) {
        if (!row_edge(edges[e])) continue;
        const int child = g.index.at(edges[e].function.get());
        const bool inside = std::find(nodes.begin(), nodes.end(), child) != nodes.end();
        const bool operand =
            (c == a.core.qk && (static_cast<int>(e) == query_edge || key_edge.count({c, static_cast<int>(e)}))) ||
            (c == a.core.pv && e == 1);
        if (inside || operand) continue;
        throw Error(fmt::format(
            "collider cannot rewrite node {} (#{}): the scores of an attention from the tokens to another "
            "sequence (a cross-attention onto an encoder's source) take a gradient from node {} (#{}), over both "
            "sequences' positions, which collider does not cut. {}",
            plan.nodes[c].type, c, plan.nodes[child].type, child, kOtherLength));
      }
    }
    keep_query_rows_only(plan, a);
  }
}

}  // namespace collider::detail
