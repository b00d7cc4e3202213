// The field cut (field_cut.h) and the edit that applies it: every node with token-shaped fields
// that no earlier edit of the table took has its saved tensors, recorded sizes and expected input
// shapes cut to the kept rows, so its backward runs on [B, N] tokens (DESIGN.md section 3). A
// Python custom Function that trace_plan ran row for row has its ctx.saved_tensors cut the same
// way; x[..., :n].copy_(y) (CopySlices) has its two geometries cut together (slices.h).
// Its analysis steps, run when the plan is built (edit.h), at the end of this file: the row order of
// flattened [B*T] rows, the broadcast layouts of token fields without a batch dimension, Python
// custom Functions run to see they map rows one to one, and attention sinks' T + c key columns.
#include "field_cut.h"

#include "edit.h"

#include "../passthrough.h"
#include "../routes.h"
#include "../slices.h"

#include <fmt/format.h>

#include <cstring>
#include <optional>
#include <set>

namespace collider::detail {

namespace {

bool two_token_dims(const ShapeSpec& s) {
  int n = 0;
  for (const auto& d : s.dims) n += d.kind != DimKind::kBatch;
  return n >= 2;
}

}  // namespace

void FieldCut::saved_list(const char* name, std::vector<SavedVariable>& v) {
  for (size_t i = 0; i < v.size(); ++i) on_saved(name, static_cast<int32_t>(i), v[i]);
}

void FieldCut::sizes(const char* name, std::vector<c10::SymInt>& v) {
  const size_t len = std::strlen(name);
  if (is_strides_field(name)) {
    // Recompute as contiguous strides of the sibling sizes, when those were cut.
    if (cut_sizes_.empty()) return;
    auto it = cut_sizes_.find(std::string(name, len - 8) + "_sizes");
    if (it != cut_sizes_.end()) assign(v, to_syms(contiguous_strides(it->second)));
    return;
  }
  if (auto* f = find(name, 0, FieldKind::kSizes)) {
    auto out = apply_sizes(*f, to_ints(v));
    cut_sizes_[name] = out;
    assign(v, to_syms(out));
  }
}

void FieldCut::sizes_list(const char* name, std::vector<std::vector<c10::SymInt>>& v) {
  for (size_t i = 0; i < v.size(); ++i)
    if (auto* f = find(name, static_cast<int32_t>(i), FieldKind::kSizes))
      assign(v[i], to_syms(apply_sizes(*f, to_ints(v[i]))));
}

// A slice's end along T + c key positions (attention sinks sliced off, [..., :T]): T -> N where
// the keys are cut.
void FieldCut::opt_symint(const char* name, std::optional<c10::SymInt>& v) {
  const FieldSpec* f = v ? find(name, 0, FieldKind::kSizes) : nullptr;
  if (!f) return;
  auto out = apply_sizes(*f, {v->expect_int()});
  assign(v, std::optional<c10::SymInt>(c10::SymInt(out.at(0))));
}

void FieldCut::opt_sizes(const char* name, c10::OptionalArray<c10::SymInt>& v) {
  if (!v.list) return;
  if (auto* f = find(name, 0, FieldKind::kSizes)) assign(*v.list, to_syms(apply_sizes(*f, to_ints(*v.list))));
}

void FieldCut::int_sizes(const char* name, std::vector<int64_t>& v) {
  if (auto* f = find(name, 0, FieldKind::kSizes)) assign(v, apply_sizes(*f, v));
}

void FieldCut::type_and_size(const char* name, torch::autograd::generated::TypeAndSize& v) {
  if (auto* f = find(name, 0, FieldKind::kSizes)) assign(v.sym_sizes, to_syms(apply_sizes(*f, to_ints(v.sym_sizes))));
}

void FieldCut::copy_slices(torch::autograd::CopySlices& cs) {
  const FieldSpec* base = find("slice:base", 0, FieldKind::kSizes);
  const FieldSpec* view = find("slice:view", 0, FieldKind::kSizes);
  if (!base || !view) return;
  if (auto why = copy_slices_unsupported(cs); !why.empty()) mismatch(*base, why);
  auto cut = cut_copy_slices(cs, apply_sizes(*base, to_ints(cs.base.sym_sizes())),
                             apply_sizes(*view, to_ints(cs.view.sym_sizes())));
  assign(cs.base, std::move(cut.first));
  assign(cs.view, std::move(cut.second));
}

void FieldCut::inputs() {
  for (const auto& f : spec_.fields) {
    if (f.kind != FieldKind::kInputMeta) continue;
    auto out = apply_sizes(f, to_ints(node_->input_metadata(f.item).shape_as_dim_vector()));
    torch::autograd::Node* node = node_.get();
    const uint32_t item = static_cast<uint32_t>(f.item);
    tx_.defer([node, item, other = std::vector<c10::SymInt>(out.begin(), out.end())]() mutable {
      auto& shape = node->mutable_input_metadata(item).mutable_shape_as_dim_vector();
      std::vector<c10::SymInt> current(shape.begin(), shape.end());
      shape.assign(other.begin(), other.end());
      other = std::move(current);
    });
  }
}

void FieldCut::mismatch(const FieldSpec& f, const std::string& what) const {
  throw Error(
      fmt::format("filter_backward: the graph does not match the plan at node #{} {} field {}: {}. "
                  "Re-trace the plan for this model (collider::trace_plan).",
                  index_, spec_.type, f.name, what));
}

// A field of a mixture-of-experts route behind saved-tensor hooks, which keeps all its rows (routes.h).
bool FieldCut::in_hooked_route(const FieldSpec& f) const {
  for (const auto& d : f.shape.dims)
    if (d.routed() && tx_.index().hooked_route(d.route)) return true;
  return false;
}

std::vector<int64_t> FieldCut::apply_sizes(const FieldSpec& f, const std::vector<int64_t>& values) {
  if (in_hooked_route(f)) return values;
  auto bad = tx_.index().mismatch(values, f.shape);
  if (!bad.empty()) mismatch(f, bad);
  if (tx_.masked()) return values;
  auto out = tx_.index().cut_sizes(values, f.shape, tx_.cut_keys());
  if (packed_) out[0] = tx_.index().kept_total();  // [B*T, D] -> [S, D] (packed_token_output)
  if (out != values) changed = true;
  return out;
}

void FieldCut::on_saved(const char* name, int32_t item, SavedVariable& v) {
  const FieldSpec* f = find(name, item, FieldKind::kSaved);
  if (!f) return;
  const auto& ix = tx_.shared_index();
  if (in_hooked_route(*f)) {
    // The route keeps its rows; a gather's index turns into rows of the cut token rows, a dropped
    // token's into row 0, where its zero gradient adds nothing.
    if (tx_.masked() || !f->shape.remaps_values()) return;
    auto shape = f->shape;
    replace_saved(name, v, [ix, shape](const torch::Tensor& index) { return ix->hooked_route_values(index, shape); });
    return;
  }
  // The kept_only oracle of the masked method touches only the attention probabilities (a field with a
  // key dimension inside a core). A broadcast one (no batch dimension: a causal mask shared by the
  // batch's sequences) is not the probabilities, which depend on each sequence, and is left as it is.
  const bool masked_probabilities =
      tx_.cut_keys() && spec_.attention_core && f->shape.has_key() && f->shape.pad_rank == 0;
  if (tx_.masked() && !masked_probabilities) return;
  // Ragged masks: padding keys get no attention probability (kept_only), so they neither
  // give nor receive gradient; P is the field with a query and a key dimension.
  const bool zero_keys = !tx_.masked() && tx_.cut_keys() && ix->ragged() && spec_.attention_core &&
                         f->shape.has_key() && two_token_dims(f->shape);
  if (v.has_hooks()) {
    if (f->shape.has_routed()) {
      throw Error(fmt::format(
          "filter_backward: node #{} {} saves a mixture-of-experts route's rows behind saved-tensor hooks "
          "(checkpointing or offloading), which collider does not filter yet; leave those layers unhooked or use "
          "method loss_only",
          index_, spec_.type));
    }
    // Behind saved-tensor hooks (checkpointing, offloading): the tensor exists only when the
    // backward unpacks it; its cut is decided now and made then (saved_cut.h).
    SavedCut::CutFn fn;
    if (tx_.masked()) {
      fn = tx_.zero_dropped_fn(f->shape);
    } else if (packed_) {
      fn = tx_.packed_cut_fn(f->shape);
    } else {
      fn = tx_.cut_fn(f->shape, zero_keys, /*check=*/true);
    }
    cut_behind_hooks(v, std::move(fn));
    return;
  }
  torch::Tensor t = unpacked(name, v);
  if (!t.defined()) return;
  auto bad = ix->mismatch(t.sizes(), f->shape);
  if (!bad.empty()) mismatch(*f, bad);
  if (f->shape.remaps_values() && !ix->is_route_index(t, f->shape)) {
    mismatch(*f, "it gathers by another index than the one its mixture-of-experts route scatters back by");
  }
  t = t.detach();
  std::optional<Transaction::CutRef> ref;
  if (tx_.masked()) {
    if (!t.is_floating_point()) return;
    ref = Transaction::CutRef{std::make_shared<SavedCut>(t, tx_.zero_dropped_fn(f->shape)), {}};
  } else if (packed_) {
    ref = tx_.cut_saved_packed(t);
  } else {
    ref = tx_.cut_saved(t, f->shape, zero_keys);
  }
  if (!ref) return;  // nothing to cut (keys under exact_query)
  tx_.defer(
      [&v, other = std::make_shared<SavedVariable>(saved_cut_variable(ref->cut, ref->view))] { std::swap(v, *other); });
  changed = true;
}

// A saved tensor not behind hooks, as the node holds it.
torch::Tensor FieldCut::unpacked(const char* name, SavedVariable& v) const {
  try {
    return v.unpack(node_);
  } catch (const std::exception& e) {
    throw Error(
        fmt::format("filter_backward: cannot read saved tensor {} of node #{} {} ({}). Call "
                    "filter_backward once per loss, before loss.backward().",
                    name, index_, spec_.type, first_line(e.what())));
  }
}

// A saved tensor behind saved-tensor hooks: made by `fn` from what the hooks unpack, when the
// backward first reads it (saved_cut.h).
void FieldCut::cut_behind_hooks(SavedVariable& v, SavedCut::CutFn fn) {
  auto slot = std::make_shared<SavedVariable>();
  auto cut = std::make_shared<SavedCut>(WeakNodePtr(node_), slot, tx_.keep_sources(), std::move(fn));
  *slot = saved_cut_variable(cut);
  tx_.count_hooked();
  tx_.defer_hooked(v, slot);
  changed = true;
}

// A saved tensor replaced by `fn` of it, behind hooks or not.
void FieldCut::replace_saved(const char* name, SavedVariable& v, SavedCut::CutFn fn) {
  if (v.has_hooks()) {
    cut_behind_hooks(v, std::move(fn));
    return;
  }
  torch::Tensor t = unpacked(name, v);
  if (!t.defined()) return;
  auto cut = std::make_shared<SavedCut>(t.detach(), std::move(fn));
  tx_.defer([&v, other = std::make_shared<SavedVariable>(saved_cut_variable(cut, {}))] { std::swap(v, *other); });
  changed = true;
}

namespace {

class FieldCutEdit final : public Edit {
 public:
  const char* name() const override { return "field cut"; }
  bool takes(const Graph&, int i, const Transaction& tx) const override { return !tx.plan().nodes[i].fields.empty(); }
  void cut(const Graph& g, int i, Transaction& tx) override {
    const NodePtr& node = g.nodes[i];
    FieldCut apply(tx, node, tx.plan().nodes[i], i);
    if (const NodeFields* nf = find_node_fields(*node)) {
      nf->visit(node.get(), apply);
    } else if (auto* saved = custom_saved(*node)) {  // a Python custom Function trace_plan ran row for row
      apply.saved_list("ctx.saved_tensors", *saved);
    } else if (auto* cs = as_copy_slices(*node)) {  // x[..., :n].copy_(y) (slices.h)
      apply.copy_slices(*cs);
    }
    apply.inputs();
    if (apply.changed) ++tx.stats().nodes_rewritten;
  }
};

}  // namespace

std::unique_ptr<Edit> make_field_cut_edit() { return std::make_unique<FieldCutEdit>(); }

// ---- the analysis steps (edit.h): what build_plan runs for the field cut ----

namespace {

// Broadcast layouts, resolved parents-first: a token field without a batch dimension takes the
// layout of a batch-carrying tensor of its node or of a consumer. With B = 1 a batch-less token
// field is cut as it is (every row belongs to the one sequence).
void resolve_broadcast(const Graph& ga, Sizes sa, PlanData& plan,
                       const std::vector<std::vector<std::vector<int64_t>>>& values) {
  std::vector<std::optional<RefLayout>> node_ref(plan.nodes.size());
  for (int i : sa.B == 1 ? std::vector<int>{} : topological_order(ga)) {
    NodeSpec& ns = plan.nodes[i];
    std::optional<RefLayout> ref;
    for (const auto& f : ns.fields)  // input metadata first, then saved fields
      if (f.kind == FieldKind::kInputMeta && !ref) ref = layout_of(f.shape);
    for (const auto& f : ns.fields)
      if (!ref) ref = layout_of(f.shape);
    if (!ref) {
      for (const auto& [p, e] : ga.parents[i])
        if (!ref && node_ref[p]) ref = node_ref[p];
    }
    for (size_t k = 0; k < ns.fields.size(); ++k) {
      FieldSpec& f = ns.fields[k];
      if (batch_dim(f.shape) || has_flat(f.shape) || f.shape.has_route()) continue;
      if (traits_of(ns.type).sink == SinkRole::kSlice && f.name == "end")
        continue;  // a scalar: T key positions, not a tensor
      if (!ref || !align_broadcast(f.shape, values[i][k], *ref)) {
        throw Error(
            fmt::format("collider cannot rewrite node {} (#{}): field {} has token dimensions but no "
                        "batch dimension, and no batch-carrying tensor of the node or its consumers "
                        "shows how it broadcasts",
                        ns.type, i, f.name));
      }
    }
    if (!ref) {
      for (const auto& f : ns.fields)
        if (!ref && f.kind == FieldKind::kInputMeta) ref = layout_of(f.shape);
    }
    node_ref[i] = ref;
  }
}

// Python custom Functions with token-shaped inputs or saved tensors (BLOOM's GELU) are cut like an
// ATen op where their backward maps rows one to one: rows only (no key or routed dimension), every
// gradient they return token-shaped, and the backward run on cut rows giving the full run's kept
// rows (passthrough.h: row_mismatch). Any other runs whole (NodeSpec::run_whole).
void check_python_functions(const Graph& g, PlanData& plan, const std::vector<ObservedNode>& observed,
                            const std::set<int>& nodes, Sizes s) {
  for (int i : nodes) {
    const NodeSpec& ns = plan.nodes[i];
    std::string why;
    for (const auto& f : ns.fields)
      if (why.empty() && (f.shape.has_routed() || token_dims(f.shape).size() > 1))
        why = fmt::format("field {} has more than one token dimension", f.name);
    std::vector<const FieldSpec*> outputs;
    for (const auto& e : g.nodes[i]->next_edges()) {
      outputs.push_back(e.function ? plan.nodes[g.index.at(e.function.get())].find(FieldKind::kInputMeta,
                                                                                   static_cast<int32_t>(e.input_nr))
                                   : nullptr);
    }
    if (why.empty()) why = row_mismatch(g.nodes[i], ns, observed[i].custom_saved, outputs, s.B, s.T);
    if (!why.empty()) mark_run_whole(plan.nodes[i]);
  }
}

// Attention sinks (kTokenPlus): in a recognised attention core, a cat must append the c fixed columns
// after the T scores and a slice keep [..., :T]. A node with T + c positions outside an attention core
// (a convolution's padding, sliced off by [..., :T]) runs whole (NodeSpec::run_whole), unless one of
// its tensors has both T and T + c positions (scores with sinks in a core collider does not recognise).
void check_sinks(PlanData& plan, const std::vector<ObservedNode>& oa, const std::set<int>& sink_ops, Sizes sa) {
  auto refuse = [&](int i, const std::string& why) {
    throw Error(
        fmt::format("collider cannot rewrite node {} (#{}): {}; collider follows T + c positions only as "
                    "attention sinks (cat(scores, sinks) -> softmax -> [..., :T])",
                    plan.nodes[i].type, i, why));
  };
  for (size_t i = 0; i < plan.nodes.size(); ++i) {
    const NodeSpec& ns = plan.nodes[i];
    bool plus = false;
    for (const auto& f : ns.fields)
      for (const auto& d : f.shape.dims) plus = plus || d.kind == DimKind::kTokenPlus;
    const int node = static_cast<int>(i);
    if (!plus && !sink_ops.count(node)) continue;
    if (traits_of(ns.type).sink == SinkRole::kMax && ns.fields.empty())
      continue;  // a detached row maximum (attention_cores.cpp)
    if (!ns.attention_core) {
      bool both = false;
      for (const auto& f : ns.fields) {
        bool token = false, token_plus = false;
        for (const auto& d : f.shape.dims) {
          token = token || d.kind == DimKind::kToken;
          token_plus = token_plus || d.kind == DimKind::kTokenPlus;
        }
        both = both || (token && token_plus);
      }
      if (both) refuse(node, "T + c positions outside an attention core");
      mark_run_whole(plan.nodes[i]);
      continue;
    }
    if (!sink_ops.count(node)) continue;
    const ObservedNode& o = oa[i];
    const SinkRole sink = traits_of(ns.type).sink;
    if (sink == SinkRole::kSlice) {
      int64_t start = 0, end = -1, step = 1;
      for (const auto& f : o.fields) {
        if (f.name == "start" && f.scalar) start = f.values[0];
        if (f.name == "end" && f.scalar) end = f.values[0];
        if (f.name == "step" && f.scalar) step = f.values[0];
      }
      int64_t fixed = 0;  // c
      if (const FieldSpec* self = ns.find(FieldKind::kSizes, 0, "self_sym_sizes"))
        for (const auto& d : self->shape.dims)
          if (d.kind == DimKind::kTokenPlus) fixed = d.mult;
      if (start != 0 || step != 1 || (end != sa.T && end != -fixed) || fixed == 0) {
        refuse(node, "a slice other than [..., :T] of T + c positions");
      }
    } else if (sink == SinkRole::kCat) {
      const FieldSpec* scores = ns.find(FieldKind::kSizes, 0, "tensors_args_sizes_symint");
      const FieldSpec* sinks = ns.find(FieldKind::kSizes, 1, "tensors_args_sizes_symint");
      const int64_t rank = scores ? scores->shape.rank : 0;
      const int64_t d = *o.dim < 0 ? *o.dim + rank : *o.dim;
      bool scores_first = false,
           fixed_after = sinks != nullptr && !ns.find(FieldKind::kSizes, 2, "tensors_args_sizes_symint");
      if (scores)
        for (const auto& dim : scores->shape.dims)
          scores_first = scores_first || (dim.dim == d && dim.kind == DimKind::kToken);
      if (sinks)
        for (const auto& dim : sinks->shape.dims) fixed_after = fixed_after && dim.dim != d;
      if (!scores_first || !fixed_after) refuse(node, "a concatenation other than cat(scores [.., T], sinks [.., c])");
    }
  }
}

}  // namespace

// The order of flattened [B*T] rows (classify.h).
void field_cut_flat_order(const TraceFacts& t, PlanData& plan) { resolve_flat_order(t.ga, plan, t.oa); }

void field_cut_broadcast(const TraceFacts& t, PlanData& plan) {
  resolve_broadcast(t.ga, t.sa, plan, t.classified.values);
  // A gradient over query and key positions that the batch's sequences share (T5's relative position
  // bias, [1, H, T, T], learned): cut per sequence it would need a batch dimension the ops below it
  // (unsqueeze, permute, the bias's embedding) do not have.
  for (size_t i = 0; i < plan.nodes.size(); ++i) {
    for (const auto& f : plan.nodes[i].fields) {
      if (f.kind != FieldKind::kInputMeta || f.shape.pad_rank == 0 || !two_token_dims(f.shape)) continue;
      throw Error(fmt::format(
          "collider cannot rewrite node {} (#{}): its gradient spans query and key positions and has no batch "
          "dimension (a position bias learned over both, shared by the batch's sequences), which a cut per "
          "sequence cannot keep shared. Freeze that bias (requires_grad_(False)), or train the model without "
          "token filtering",
          plan.nodes[i].type, i));
    }
  }
}

void field_cut_python_functions(const TraceFacts& t, PlanData& plan) {
  check_python_functions(t.ga, plan, t.oa, t.classified.python_functions, t.sa);
}

void field_cut_sinks(const TraceFacts& t, PlanData& plan) { check_sinks(plan, t.oa, t.classified.sink_ops, t.sa); }

}  // namespace collider::detail
