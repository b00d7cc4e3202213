// Internal: an in-place write into a slice of a token-shaped tensor (x[..., :n].copy_(y), as
// DeepSeek's latent attention assembles its keys from two parts), whose backward node is
// torch::autograd::CopySlices: not an ATen op from Functions.h, its fields two TensorGeometry
// (the written tensor, `base`, and the slice, `view`). Cut along token dimensions when the slice
// leaves the token dimensions whole: base contiguous, the slice of the same rank and strides,
// starting inside the dimensions after the last token one, and its inner node (copy_) saving
// nothing. passes/field_dims.cpp classifies the two geometries' sizes (fields "slice:base", "slice:view"),
// the field cut (edits/field_cut.cpp) writes the cut geometries. Tests: python/tests/test_moe.py
// (DeepSeek-V3), tests/test_core_plan.cpp.
#pragma once

#include <ATen/TensorGeometry.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/tensor.h>

#include <string>
#include <utility>
#include <vector>

namespace collider::detail {

// nullptr unless the node is a CopySlices.
torch::autograd::CopySlices* as_copy_slices(torch::autograd::Node& node);
// Empty when collider can cut this slice write (see above), else why not.
std::string copy_slices_unsupported(const torch::autograd::CopySlices& node);
// The geometries for cut sizes of base and view (as TokenIndex::cut_sizes gives them): base
// contiguous, the slice with its strides at the same offset. Throws collider::Error where the
// slice's offset reaches into a cut dimension.
std::pair<at::TensorGeometry, at::TensorGeometry> cut_copy_slices(const torch::autograd::CopySlices& node,
                                                                  const std::vector<int64_t>& base_sizes,
                                                                  const std::vector<int64_t>& view_sizes);

}  // namespace collider::detail
