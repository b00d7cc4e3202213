// The one place for what differs between the torch releases Collider builds against (2.11.0 to
// 2.15.x; docs/COMPATIBILITY.md has the test behind each). Everything else speaks this file's
// vocabulary and never tests a torch version:
//   NodePtr            an owning pointer to an autograd node (what an Edge and grad_fn() hold)
//   NodePtrOf<T>       the same for a node type of ours (converts to NodePtr)
//   WeakNodePtr        a non-owning one (lock() gives a NodePtr, or null once the node is gone)
//   make_node<T>(...)  a new node of type T, owned the way torch owns its nodes
// Each difference names the release that changed it and why. The build-side ones (the C++ standard
// the headers need, the wheel's CUDA libraries) are in cmake/ColliderTorch.cmake.
#pragma once

#include <torch/csrc/autograd/function.h>
#include <torch/version.h>

#include <memory>
#include <utility>

#define COLLIDER_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// The range this source tree is written and tested for; CMake refuses a libtorch outside it at
// configure time (cmake/ColliderDeps.cmake), this check catches a build that bypasses CMake.
static_assert(COLLIDER_TORCH_AT_LEAST(2, 11) && !COLLIDER_TORCH_AT_LEAST(2, 16),
              "Collider supports torch 2.11 to 2.15 (docs/COMPATIBILITY.md); install one of those");

namespace collider {

// torch 2.13.0: autograd nodes became c10::intrusive_ptr_target, owned by c10::intrusive_ptr
// (the count lives in the node, one allocation less per node); before, std::shared_ptr with
// enable_shared_from_this.
#if COLLIDER_TORCH_AT_LEAST(2, 13)
template <class T>
using NodePtrOf = c10::intrusive_ptr<T>;
using WeakNodePtr = c10::weak_intrusive_ptr<torch::autograd::Node>;
template <class T, class... Args>
NodePtrOf<T> make_node(Args&&... args) {
  return c10::make_intrusive<T>(std::forward<Args>(args)...);
}
#else
template <class T>
using NodePtrOf = std::shared_ptr<T>;
using WeakNodePtr = std::weak_ptr<torch::autograd::Node>;
template <class T, class... Args>
NodePtrOf<T> make_node(Args&&... args) {
  return std::make_shared<T>(std::forward<Args>(args)...);
}
#endif
using NodePtr = NodePtrOf<torch::autograd::Node>;

// torch 2.13.0: the Python object of a node made by a torch.autograd.Function (a PyNode) is read
// with pyobj(); before, it was the public field obj. Both are the THPFunction the node wraps.
template <class PyNodeT>
auto python_object(const PyNodeT& node) {
#if COLLIDER_TORCH_AT_LEAST(2, 13)
  return node.pyobj();
#else
  return node.obj;
#endif
}

}  // namespace collider
