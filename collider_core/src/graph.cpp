// Breadth-first walk of the autograd graph from the loss (see graph.h).
#include "graph.h"

#include "node_traits.h"
#include "passthrough.h"

#include <deque>
#include <string>

namespace collider::detail {

Graph collect_graph(const NodePtr& root, size_t expected_nodes) {
  Graph g;
  g.nodes.reserve(expected_nodes);
  g.parents.reserve(expected_nodes);
  g.index.reserve(expected_nodes);
  std::deque<torch::autograd::Node*> queue;
  auto visit = [&](const NodePtr& n) {
    auto [it, inserted] = g.index.emplace(n.get(), static_cast<int>(g.nodes.size()));
    if (inserted) {
      g.nodes.push_back(n);
      g.parents.emplace_back();
      queue.push_back(n.get());
    }
    return it->second;
  };
  visit(root);
  while (!queue.empty()) {
    torch::autograd::Node* n = queue.front();
    queue.pop_front();
    const int parent = g.index.at(n);
    const auto& edges = n->next_edges();
    for (size_t e = 0; e < edges.size(); ++e) {
      if (!edges[e].function) continue;
      const int child = visit(edges[e].function);
      g.parents[child].emplace_back(parent, static_cast<int>(e));
    }
  }
  return g;
}

std::vector<const std::string*> node_types(const Graph& g, NodeNames& names) {
  std::vector<const std::string*> types;
  types.reserve(g.nodes.size());
  for (const auto& n : g.nodes) {
    if (custom_saved(*n)) {  // a Python custom Function
      types.push_back(&names.per_node.emplace_back(n->name()));
      continue;
    }
    auto it = names.by_type.find(typeid(*n));
    if (it == names.by_type.end()) it = names.by_type.emplace(typeid(*n), n->name()).first;
    types.push_back(&it->second);  // an unordered_map's elements stay where they are
  }
  return types;
}

NodePtr loss_root(const NodePtr& grad_fn) {
  auto one_number = [](const torch::autograd::InputMetadata& m) {
    if (m.is_nested_tensor() || m.is_cpp_nested_tensor()) return false;
    int64_t n = 1;
    for (const auto& s : m.shape_as_dim_vector()) n *= s.expect_int();
    return n == 1;
  };
  NodePtr node = grad_fn;
  while (node && node->num_inputs() == 1 && one_number(node->input_metadata(0))) {
    if (!traits_of(node->name()).loss_scaling) break;
    const torch::autograd::Edge* live = nullptr;
    int num_live = 0;
    for (const auto& e : node->next_edges()) {
      if (e.function) {
        live = &e;
        ++num_live;
      }
    }
    if (num_live != 1 || !one_number(live->function->input_metadata(live->input_nr))) break;
    node = live->function;
  }
  return node;
}

std::vector<int> topological_order(const Graph& g) {
  const int n = static_cast<int>(g.nodes.size());
  std::vector<int> indeg(n, 0);
  for (int i = 0; i < n; ++i) indeg[i] = static_cast<int>(g.parents[i].size());
  std::deque<int> q;
  for (int i = 0; i < n; ++i)
    if (indeg[i] == 0) q.push_back(i);
  std::vector<int> order;
  while (!q.empty()) {
    int i = q.front();
    q.pop_front();
    order.push_back(i);
    for (const auto& e : g.nodes[i]->next_edges()) {
      if (!e.function) continue;
      int c = g.index.at(e.function.get());
      if (--indeg[c] == 0) q.push_back(c);
    }
  }
  return order;
}

}  // namespace collider::detail
