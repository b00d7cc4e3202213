// collider::Error: the one exception type that leaves Collider's public API (collider.h,
// select.h). Every refusal (a node the rewriter cannot cut, a graph that does not match its
// plan, a bad mask or ratio) is one, with a message that says what to do; the graph it was
// given is unchanged. Python sees it as collider.Error.
#pragma once

#include <stdexcept>
#include <string>

namespace collider {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

}  // namespace collider
