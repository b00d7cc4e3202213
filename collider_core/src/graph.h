// Internal: the autograd graph hanging off a loss, in a deterministic node order.
// The order (breadth-first from loss.grad_fn, edges in order) is what a Plan replays.
#pragma once

#include "collider/torch_compat.h"

#include <deque>
#include <memory>
#include <string>
#include <typeindex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace collider::detail {

struct Graph {
  std::vector<NodePtr> nodes;
  std::unordered_map<const torch::autograd::Node*, int> index;
  // parents[i]: (parent node index, edge index in the parent) for every edge into node i.
  std::vector<std::vector<std::pair<int, int>>> parents;
};

// expected_nodes: a size hint (a plan's node count), so replaying a plan does not regrow tables.
Graph collect_graph(const NodePtr& root, size_t expected_nodes = 0);

// Node::name() of every node of g (what a plan's NodeSpec::type records). Node::name() demangles on
// every call: node_types demangles once per type into `names`, and types[i] points there. Every
// Python custom Function's node is one C++ type (a PyNode) named after its Function: read per node.
struct NodeNames {
  std::unordered_map<std::type_index, std::string> by_type;
  std::deque<std::string> per_node;  // a deque's elements stay where they are
};
std::vector<const std::string*> node_types(const Graph& g, NodeNames& names);

// The node indices of g, every node after all the nodes with an edge into it (backward order).
std::vector<int> topological_order(const Graph& g);

// The node a plan starts at: loss.grad_fn() below any scaling of the scalar loss by a constant
// (loss / n for gradient accumulation or a token count, loss * w, a loss scaler's multiply, -loss,
// a cast): one operand needs no gradient and the input and output are one number. A plan traced on
// the unscaled loss then serves the scaled one, and the reverse; the scaling itself runs unchanged.
NodePtr loss_root(const NodePtr& grad_fn);

}  // namespace collider::detail
