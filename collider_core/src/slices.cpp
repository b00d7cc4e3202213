// In-place writes into a slice of a token-shaped tensor (see slices.h).
#include "slices.h"

#include <collider/collider.h>

#include "node_fields.h"

#include <fmt/format.h>

namespace collider::detail {

torch::autograd::CopySlices* as_copy_slices(torch::autograd::Node& node) {
  return dynamic_cast<torch::autograd::CopySlices*>(&node);
}

std::string copy_slices_unsupported(const torch::autograd::CopySlices& node) {
  if (node.view_fn) return "the slice is replayed by a view function";
  // copy_'s node saves only the source's options; any other in-place op would have fields to cut.
  if (!node.fn || !dynamic_cast<torch::autograd::CopyBackwards*>(node.fn.get()))
    return fmt::format("the op written in place is {}, not copy_", node.fn ? node.fn->name() : "unknown");
  const auto base_sizes = to_ints(node.base.sym_sizes()), view_sizes = to_ints(node.view.sym_sizes());
  if (to_ints(node.base.sym_strides()) != contiguous_strides(base_sizes)) return "the written tensor is not contiguous";
  if (view_sizes.size() != base_sizes.size() || to_ints(node.view.sym_strides()) != to_ints(node.base.sym_strides()))
    return "the slice is not a slice of the written tensor's own dimensions";
  return {};
}

std::pair<at::TensorGeometry, at::TensorGeometry> cut_copy_slices(const torch::autograd::CopySlices& node,
                                                                  const std::vector<int64_t>& base_sizes,
                                                                  const std::vector<int64_t>& view_sizes) {
  const auto old_base = to_ints(node.base.sym_sizes()), old_view = to_ints(node.view.sym_sizes());
  const auto strides = contiguous_strides(base_sizes);
  const int64_t offset = node.view.sym_storage_offset().expect_int() - node.base.sym_storage_offset().expect_int();
  // The slice keeps every dimension the cut changes whole, is cut with it, and starts inside the
  // dimensions after the last one the cut changes.
  for (size_t d = 0; d < old_base.size(); ++d) {
    const bool cut = old_base[d] != base_sizes[d];
    if (cut != (old_view[d] != view_sizes[d]) || (cut && (old_view[d] != old_base[d] || view_sizes[d] != base_sizes[d]))) {
      throw Error(fmt::format("collider cannot cut node {}: the slice written in place is not whole along the "
                              "token dimensions; build the tensor with torch.cat",
                              node.name()));
    }
    if (cut && offset >= strides[d]) {
      throw Error(fmt::format("collider cannot cut node {}: the slice written in place starts inside a token "
                              "dimension; build the tensor with torch.cat",
                              node.name()));
    }
  }
  auto syms = [](const std::vector<int64_t>& v) { return std::vector<c10::SymInt>(v.begin(), v.end()); };
  at::TensorGeometry base(syms(base_sizes), syms(strides), node.base.sym_storage_offset());
  at::TensorGeometry view(syms(view_sizes), syms(strides), node.view.sym_storage_offset());
  return {std::move(base), std::move(view)};
}

}  // namespace collider::detail
