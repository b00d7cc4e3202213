// Internal: uniform access to the saved tensors and size fields of autograd nodes.
// The table behind find_node_fields() is generated from libtorch's Functions.h at build time
// (codegen/gen_node_fields.py): the rewriter never hand-lists node types.
#pragma once

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/autograd/generated/Functions.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

namespace collider::detail {

using torch::autograd::SavedVariable;

// One callback per field kind. `name` is the C++ field name in Functions.h.
struct FieldVisitor {
  virtual ~FieldVisitor() = default;
  virtual void saved(const char* name, SavedVariable& v) = 0;
  virtual void saved_list(const char* name, std::vector<SavedVariable>& v) = 0;
  virtual void sizes(const char* name, std::vector<c10::SymInt>& v) = 0;
  virtual void sizes_list(const char* name, std::vector<std::vector<c10::SymInt>>& v) = 0;
  virtual void symint(const char* name, c10::SymInt& v) = 0;
  virtual void opt_symint(const char* name, std::optional<c10::SymInt>& v) = 0;
  virtual void opt_sizes(const char* name, c10::OptionalArray<c10::SymInt>& v) = 0;
  virtual void int_sizes(const char* name, std::vector<int64_t>& v) = 0;
  virtual void type_and_size(const char* name, torch::autograd::generated::TypeAndSize& v) = 0;
  virtual void geometry(const char* name, at::TensorGeometry& v) = 0;
  virtual void int64(const char* name, int64_t& v) = 0;
};

// A visitor that ignores every field; derive and override the kinds you read.
struct IgnoringFieldVisitor : FieldVisitor {
  void saved(const char*, SavedVariable&) override {}
  void saved_list(const char*, std::vector<SavedVariable>&) override {}
  void sizes(const char*, std::vector<c10::SymInt>&) override {}
  void sizes_list(const char*, std::vector<std::vector<c10::SymInt>>&) override {}
  void symint(const char*, c10::SymInt&) override {}
  void opt_symint(const char*, std::optional<c10::SymInt>&) override {}
  void opt_sizes(const char*, c10::OptionalArray<c10::SymInt>&) override {}
  void int_sizes(const char*, std::vector<int64_t>&) override {}
  void type_and_size(const char*, torch::autograd::generated::TypeAndSize&) override {}
  void geometry(const char*, at::TensorGeometry&) override {}
  void int64(const char*, int64_t&) override {}
};

struct NodeFields {
  const char* node_name;
  void (*visit)(torch::autograd::Node* node, FieldVisitor& v);
  const char* described_fields;  // "SavedVariable self_, int64_t dim, ..." for error messages
};

// The values of a size field (every size of a traced or rewritten graph is a concrete integer).
inline std::vector<int64_t> to_ints(c10::SymIntArrayRef a) {
  std::vector<int64_t> out;
  out.reserve(a.size());
  for (const auto& s : a) out.push_back(s.expect_int());
  return out;
}

// Contiguous strides of `sizes` (a size-0 or size-1 dimension counts as 1, as torch's own do).
inline std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> st(sizes.size(), 1);
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 2; d >= 0; --d)
    st[d] = st[d + 1] * std::max<int64_t>(sizes[d + 1], 1);
  return st;
}

// A size field that holds strides (Functions.h: <x>_sym_strides beside its sizes <x>_sym_sizes).
inline bool is_strides_field(std::string_view name) {
  return name.size() > 8 && name.compare(name.size() - 8, 8, "_strides") == 0;
}

// nullptr for node types not declared in Functions.h (AccumulateGrad, custom Functions, ...).
const NodeFields* find_node_fields(const torch::autograd::Node& node);
int num_generated_node_types();
// Their names (Node::name()), in Functions.h order.
const std::vector<const char*>& generated_node_types();

}  // namespace collider::detail
