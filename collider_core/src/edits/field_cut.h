// Internal: the default cut, shared by the edits that rewrite a node in place (field_cut.cpp,
// packed_rows.cpp). It goes through one node's fields with the handlers generated from torch's
// Functions.h (node_fields.h) and applies the plan's FieldSpec of each: a token-shaped saved
// tensor is replaced by its cut to the kept rows (made when the backward first reads it,
// saved_cut.h), a size list recording a token dimension is shrunk to the kept count, and so is
// every input shape the node expects. Tensors behind saved-tensor hooks (checkpointing,
// offloading) are cut when the hooks unpack them. Every write goes through the transaction.
#pragma once

#include "../node_fields.h"
#include "../transaction.h"

#include <map>
#include <string>
#include <vector>

namespace torch::autograd {
struct CopySlices;
}

namespace collider::detail {

class FieldCut final : public FieldVisitor {
 public:
  // packed: the node's token fields go to the S packed kept rows (packed_rows.cpp), not B*N.
  FieldCut(Transaction& tx, const NodePtr& node, const NodeSpec& spec, int index, bool packed = false)
      : tx_(tx), node_(node), spec_(spec), index_(index), packed_(packed) {}

  bool changed = false;  // something of the node is cut

  void saved(const char* name, SavedVariable& v) override { on_saved(name, 0, v); }
  void saved_list(const char* name, std::vector<SavedVariable>& v) override;
  void sizes(const char* name, std::vector<c10::SymInt>& v) override;
  void sizes_list(const char* name, std::vector<std::vector<c10::SymInt>>& v) override;
  void symint(const char*, c10::SymInt&) override {}
  void opt_symint(const char* name, std::optional<c10::SymInt>& v) override;
  void opt_sizes(const char* name, c10::OptionalArray<c10::SymInt>& v) override;
  void int_sizes(const char* name, std::vector<int64_t>& v) override;
  void type_and_size(const char* name, torch::autograd::generated::TypeAndSize& v) override;
  void geometry(const char*, at::TensorGeometry&) override {}
  void int64(const char*, int64_t&) override {}
  // CopySlices: its two geometries, cut together (slices.h).
  void copy_slices(torch::autograd::CopySlices& cs);
  // The input shapes the node expects.
  void inputs();

 private:
  // The field is written in the commit pass, from the value computed now (a swap: see defer).
  template <typename V>
  void assign(V& field, V value) {
    tx_.defer([&field, value = std::move(value)]() mutable { std::swap(field, value); });
  }
  const FieldSpec* find(const char* name, int32_t item, FieldKind kind) const { return spec_.find(kind, item, name); }
  [[noreturn]] void mismatch(const FieldSpec& f, const std::string& what) const;
  bool in_hooked_route(const FieldSpec& f) const;
  std::vector<int64_t> apply_sizes(const FieldSpec& f, const std::vector<int64_t>& values);
  void on_saved(const char* name, int32_t item, SavedVariable& v);
  torch::Tensor unpacked(const char* name, SavedVariable& v) const;
  void cut_behind_hooks(SavedVariable& v, SavedCut::CutFn fn);
  void replace_saved(const char* name, SavedVariable& v, SavedCut::CutFn fn);

  Transaction& tx_;
  const NodePtr& node_;
  const NodeSpec& spec_;
  int index_;
  bool packed_;
  std::map<std::string, std::vector<int64_t>> cut_sizes_;
};

}  // namespace collider::detail
