// Recording a node's fields as one trace sees them (see observe.h).
#include "observe.h"

#include <collider/collider.h>

#include "node_fields.h"
#include "passthrough.h"
#include "slices.h"

#include <fmt/format.h>

namespace collider::detail {

namespace {

// Records every field of one node.
class RecordVisitor final : public FieldVisitor {
 public:
  RecordVisitor(ObservedNode& out, const NodePtr& node) : out_(out), node_(node) {}
  bool keep_custom_saved = false;

  void saved(const char* name, SavedVariable& v) override { add_saved(name, v, 0); }
  void saved_list(const char* name, std::vector<SavedVariable>& v) override {
    for (size_t i = 0; i < v.size(); ++i) add_saved(name, v[i], static_cast<int32_t>(i));
  }
  void sizes(const char* name, std::vector<c10::SymInt>& v) override { add_sizes(name, to_ints(v), 0); }
  void sizes_list(const char* name, std::vector<std::vector<c10::SymInt>>& v) override {
    for (size_t i = 0; i < v.size(); ++i) add_sizes(name, to_ints(v[i]), static_cast<int32_t>(i));
  }
  void symint(const char* name, c10::SymInt& v) override { add_scalar(name, v.expect_int()); }
  void opt_symint(const char* name, std::optional<c10::SymInt>& v) override {
    if (v) add_scalar(name, v->expect_int());
  }
  void opt_sizes(const char* name, c10::OptionalArray<c10::SymInt>& v) override {
    if (v.list) add_sizes(name, to_ints(*v.list), 0);
  }
  void int_sizes(const char* name, std::vector<int64_t>& v) override { add_sizes(name, v, 0); }
  void type_and_size(const char* name, torch::autograd::generated::TypeAndSize& v) override {
    add_sizes(name, to_ints(v.sym_sizes), 0);
  }
  void geometry(const char* name, at::TensorGeometry& v) override {
    Observed o{name, FieldKind::kSizes, 0, to_ints(v.sym_sizes()), false, true};
    o.name = std::string("geometry:") + name;  // read-only: may not carry token dims
    out_.fields.push_back(std::move(o));
  }
  void int64(const char* name, int64_t& v) override {
    if (std::string(name) == "dim") out_.dim = v;
  }

 private:
  void add_saved(const char* name, SavedVariable& v, int32_t item) {
    Observed o;
    o.name = name;
    o.kind = FieldKind::kSaved;
    o.item = item;
    at::Tensor t;
    try {
      t = v.unpack(node_);
    } catch (const std::exception& e) {
      throw Error(
          fmt::format("trace_plan: cannot read saved tensor {} of {} ({}); was backward already run "
                      "on this loss?",
                      name, out_.type, e.what()));
    }
    o.defined = t.defined();
    if (t.defined()) o.values = t.sizes().vec();
    out_.fields.push_back(std::move(o));
    if (keep_custom_saved) out_.custom_saved.push_back(t);
  }
  void add_sizes(const char* name, std::vector<int64_t> values, int32_t item) {
    out_.fields.push_back(
        Observed{name, is_strides_field(name) ? FieldKind::kStrides : FieldKind::kSizes, item, std::move(values)});
  }
  void add_scalar(const char* name, int64_t value) {
    Observed o{name, FieldKind::kSizes, 0, {value}, true, true};
    out_.fields.push_back(std::move(o));
  }
  ObservedNode& out_;
  const NodePtr& node_;
};

}  // namespace

ObservedNode observe(const NodePtr& node) {
  ObservedNode out;
  out.type = node->name();
  if (const NodeFields* nf = find_node_fields(*node)) {
    out.generated = true;
    out.described = nf->described_fields;
    RecordVisitor rec(out, node);
    nf->visit(node.get(), rec);
  } else if (auto* saved = custom_saved(*node)) {  // a Python custom Function: ctx.save_for_backward's tensors
    out.described = "ctx.saved_tensors";
    RecordVisitor rec(out, node);
    rec.keep_custom_saved = true;
    rec.saved_list("ctx.saved_tensors", *saved);
  } else if (auto* cs = as_copy_slices(*node)) {  // x[..., :n].copy_(y): its two geometries' sizes (slices.h)
    out.described = copy_slices_unsupported(*cs);
    if (out.described.empty()) {
      out.fields.push_back(Observed{"slice:base", FieldKind::kSizes, 0, to_ints(cs->base.sym_sizes())});
      out.fields.push_back(Observed{"slice:view", FieldKind::kSizes, 0, to_ints(cs->view.sym_sizes())});
    }
  }
  for (uint32_t i = 0; i < node->num_inputs(); ++i) {
    const auto& meta = node->input_metadata(i);
    Observed o;
    o.name = "input";
    o.kind = FieldKind::kInputMeta;
    o.item = static_cast<int32_t>(i);
    if (meta.is_nested_tensor() || meta.is_cpp_nested_tensor()) {
      o.defined = false;
    } else {
      o.values = to_ints(meta.shape_as_dim_vector());
    }
    out.fields.push_back(std::move(o));
  }
  return out;
}

}  // namespace collider::detail
