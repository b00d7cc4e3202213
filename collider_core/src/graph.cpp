// Breadth-first walk of the autograd graph from the loss (see graph.h).
#include "graph.h"

#include <deque>

namespace collider::detail {

Graph collect_graph(const std::shared_ptr<torch::autograd::Node>& root, size_t expected_nodes) {
  Graph g;
  g.nodes.reserve(expected_nodes);
  g.parents.reserve(expected_nodes);
  g.index.reserve(expected_nodes);
  std::deque<torch::autograd::Node*> queue;
  auto visit = [&](const std::shared_ptr<torch::autograd::Node>& n) {
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

}  // namespace collider::detail
