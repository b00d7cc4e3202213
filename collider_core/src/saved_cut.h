// Internal: saved tensors cut to the kept rows when the backward unpacks them, not when
// filter_backward runs. filter_backward decides every cut (which tensor, which rows, what shape)
// and checks it; the copy itself is made by the first node whose backward reads the tensor.
// Why (the rewrite's transaction, transaction.h, uses it for every saved tensor it cuts):
//   - memory: a full saved tensor is dropped as soon as its cut exists, so a filtered step never
//     holds a full tensor and its cut for longer than one node's backward, and its peak stays at
//     or below the unfiltered step's (cutting everything up front held all of both at once);
//   - saved-tensor hooks (activation checkpointing, offloading to the CPU, any
//     torch.autograd.graph.saved_tensors_hooks): the tensor exists only when the hook's unpack
//     makes it (recomputes it, copies it back), inside the backward; it is cut right there, with
//     the same kept rows, and checkpointing keeps its memory saving.
// Tests: tests/test_collider_saved_hooks.cpp, python/tests/test_checkpointing.py.
#pragma once

#include "collider/torch_compat.h"
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <mutex>
#include <vector>

namespace collider::detail {

// One saved tensor to cut, shared by every SavedVariable that held it (nodes that saved the same
// tensor share one copy). Its source is either the forward's tensor itself or, behind
// saved-tensor hooks, the original SavedVariable, unpacked on first use.
class SavedCut {
 public:
  // full tensor -> its cut; it may also check the tensor (shape against the plan) and throw.
  using CutFn = std::function<torch::Tensor(const torch::Tensor&)>;

  // A tensor held as it is: the cut reads it at first use, then lets it go. A change in place
  // between filter_backward and the backward is refused, as autograd refuses it.
  SavedCut(torch::Tensor source, CutFn cut);
  // A tensor behind saved-tensor hooks: the original SavedVariable, which `slot` holds once the
  // rewrite is written (the graph is untouched until then), unpacked through its hooks at first
  // use on behalf of `owner`, the node that saved it. keep_original: leave it packed after the
  // cut (filter_backward's validate runs the backward more than once and may swap it back).
  SavedCut(WeakNodePtr owner, std::shared_ptr<torch::autograd::SavedVariable> slot,
           bool keep_original, CutFn cut);

  // The cut, made on the first call; later calls (a backward with retain_graph) return it again.
  torch::Tensor get();

 private:
  std::mutex mutex_;
  torch::Tensor source_;
  uint32_t source_version_ = 0;
  std::shared_ptr<torch::autograd::SavedVariable> hooked_;
  bool keep_original_ = false;
  WeakNodePtr owner_{NodePtr()};  // null for a tensor held as it is
  CutFn cut_;
  torch::Tensor result_;
};

// A SavedVariable that unpacks to cut->get(), viewed as `view` when given (contiguous views of one
// memory share a cut). What the rewrite writes in place of a saved tensor it cuts. A
// saved_tensors_hooks context around filter_backward does not apply to it.
torch::autograd::SavedVariable saved_cut_variable(std::shared_ptr<SavedCut> cut, std::vector<int64_t> view = {});

}  // namespace collider::detail
