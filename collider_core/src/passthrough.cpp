// The passthrough-node registry (see passthrough.h): a set of node names behind a mutex.
#include "passthrough.h"

#include <collider/collider.h>

#include <mutex>
#include <set>

namespace collider {
namespace detail {

namespace {

std::mutex& passthrough_mutex() {
  static std::mutex m;
  return m;
}
std::set<std::string>& passthrough_nodes() {
  static std::set<std::string> s;
  return s;
}

}  // namespace

bool is_passthrough(const std::string& name) {
  std::lock_guard<std::mutex> lock(passthrough_mutex());
  return passthrough_nodes().count(name) > 0;
}

}  // namespace detail

void register_passthrough_node(const std::string& node_name) {
  std::lock_guard<std::mutex> lock(detail::passthrough_mutex());
  detail::passthrough_nodes().insert(node_name);
}

}  // namespace collider
