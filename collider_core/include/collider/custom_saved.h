// For a language binding: how the core reads what a custom autograd Function of that language kept
// for its backward (Python's ctx.save_for_backward), which the C++ core cannot see by itself. The
// Python module (python/src/bindings.cpp) installs a reader when it is imported; trace_plan then
// refuses, or checks row by row, a custom Function that saves token-shaped tensors
// (collider_core/src/passthrough.h). Without a reader such a node's saved tensors are unknown and
// it is refused. Not for users' code: a binding installs it once.
#pragma once

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <vector>

namespace collider::detail {

// nullptr when the node is not such a custom Function (or holds no Python object).
using CustomSavedReader = std::vector<torch::autograd::SavedVariable>* (*)(torch::autograd::Node& node);
void set_custom_saved_reader(CustomSavedReader reader);

}  // namespace collider::detail
