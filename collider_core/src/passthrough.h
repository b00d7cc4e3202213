// Internal: the registry of non-ATen autograd nodes declared passthrough (they map gradients row for
// row and save nothing token-shaped), filled by collider::register_passthrough_node (collider.h)
// and read by trace_plan. Tests: tests/test_core_plan.cpp, python/tests/test_api.py.
#pragma once

#include <string>

namespace collider::detail {

// Whether register_passthrough_node(name) was called. Thread-safe.
bool is_passthrough(const std::string& name);

}  // namespace collider::detail
