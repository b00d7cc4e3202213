// The rewrite's transaction (transaction.h): the recorded writes, the splicing vocabulary and the
// gather cache, below every edit (edits/edit.h).
#include "transaction.h"

#include <algorithm>

namespace collider::detail {

using torch::autograd::Edge;

namespace {

CacheKey key_of(const torch::Tensor& t, bool with_strides, bool padding_keys_zeroed, int64_t cut_numel,
                bool route_positions = false) {
  CacheKey key{t.data_ptr(), t.numel(),      static_cast<int>(t.scalar_type()), {}, {}, padding_keys_zeroed,
               cut_numel,    route_positions};
  if (with_strides) {
    key.strides = t.strides().vec();
    key.sizes = t.sizes().vec();
  }
  return key;
}

// A tensor unpacked through saved-tensor hooks, whose sizes filter_backward could not see: it
// must be the one the plan cuts.
void check_unpacked(const TokenIndex& ix, const torch::Tensor& t, const ShapeSpec& spec) {
  auto bad = ix.mismatch(t.sizes(), spec);
  TORCH_CHECK(bad.empty(), "collider: a saved tensor unpacked through saved-tensor hooks does not match the plan (",
              bad, "); re-trace the plan with the same checkpointing or offloading set-up");
}

}  // namespace

// Prepared and never written: our SavedVariables in the slots point at their SavedCut, which points
// at the slot; the cycle is cut here.
Transaction::~Transaction() {
  if (!committed_)
    for (auto& slot : hooked_slots_) slot->reset_data();
}

void Transaction::commit() {
  committed_ = true;
  for (auto& w : writes_) w();
  for (auto& a : adopts_) a();
}

void Transaction::revert() {
  for (auto it = writes_.rbegin(); it != writes_.rend(); ++it) (*it)();
  for (auto& slot : hooked_slots_) slot->reset_data();  // our SavedVariables, which point at their SavedCut
  writes_.clear();
}

void Transaction::finish() {
  for (auto& f : finals_) f();
  finals_.clear();
  writes_.clear();
}

Edge Transaction::redirect(const Edge& e) const {
  auto it = e.function ? stand_ins_.find(e.function.get()) : stand_ins_.end();
  return it == stand_ins_.end() ? e : Edge(it->second, e.input_nr);
}

void Transaction::replace_node(const Graph& g, int i, const NodePtr& node) {
  for (const auto& [parent, edge] : g.parents[i]) {
    defer_edge(g.nodes[parent], edge, node, g.nodes[parent]->next_edge(edge).input_nr);
  }
}

void Transaction::insert_on_edge(const NodePtr& parent, int e, const NodePtr& node) {
  node->add_next_edge(redirect(parent->next_edge(e)));
  defer_edge(parent, e, node, 0);
}

void Transaction::defer_edge(const NodePtr& parent, int e, NodePtr node, uint32_t input_nr) {
  auto* edges = &const_cast<torch::autograd::edge_list&>(parent->next_edges());
  defer([edges, e, other = Edge(std::move(node), input_nr)]() mutable { std::swap((*edges)[e], other); });
}

void Transaction::defer_hooked(SavedVariable& v, std::shared_ptr<SavedVariable> slot) {
  hooked_slots_.push_back(slot);
  defer([&v, slot] { std::swap(v, *slot); });
}

Transaction::CutRef Transaction::cut_saved_packed(const torch::Tensor& t) {
  CacheKey key = key_of(t, /*strides=*/true, false, -1);
  if (auto it = cache_.find(key); it != cache_.end()) return {it->second, {}};
  auto ix = ix_;
  auto cut = std::make_shared<SavedCut>(
      t, [ix](const torch::Tensor& x) { return timed_gather(x, [&] { return ix->cut_packed(x); }); });
  count_gather(t, ix_->kept_total() * (t.numel() / std::max<int64_t>(t.size(0), 1)));
  cache_[key] = cut;
  return {cut, {}};
}

std::optional<Transaction::CutRef> Transaction::cut_saved(const torch::Tensor& t, const ShapeSpec& spec,
                                                          bool zero_padding_keys) {
  auto want = ix_->cut_sizes(t.sizes(), spec, cut_keys_);
  // (A route's index changes its values even where it keeps every row.)
  if (spec.pad_rank == 0 && !zero_padding_keys && c10::IntArrayRef(want) == t.sizes() && !spec.remaps_values())
    return std::nullopt;
  const int64_t want_numel = c10::multiply_integers(want);
  // One gather per distinct tensor: contiguous views of the same memory share it (each takes
  // its view of the contiguous cut); any other is shared only by its own sizes and strides.
  // Broadcast fields (pad_rank > 0) are cut apart.
  std::optional<CacheKey> key;
  if (spec.pad_rank == 0) key = key_of(t, !t.is_contiguous(), zero_padding_keys, want_numel, spec.remaps_values());
  if (key) {
    if (auto it = cache_.find(*key); it != cache_.end()) {
      return CutRef{it->second, t.is_contiguous() ? want : std::vector<int64_t>{}};
    }
  }
  auto cut = std::make_shared<SavedCut>(t, cut_fn(spec, zero_padding_keys, /*check=*/false));
  count_gather(t, want_numel);
  if (key) cache_[*key] = cut;
  return CutRef{cut, key && t.is_contiguous() ? want : std::vector<int64_t>{}};
}

SavedCut::CutFn Transaction::cut_fn(const ShapeSpec& spec, bool zero_padding_keys, bool check) const {
  auto ix = ix_;
  const bool cut_keys = cut_keys_;
  return [ix, spec, zero_padding_keys, cut_keys, check](const torch::Tensor& t) {
    if (check) check_unpacked(*ix, t, spec);
    auto want = ix->cut_sizes(t.sizes(), spec, cut_keys);
    if (spec.pad_rank == 0 && c10::IntArrayRef(want) == t.sizes() && !spec.remaps_values()) {
      return zero_padding_keys ? ix->zero_padding(t, spec, /*keys_only=*/true) : t;
    }
    return timed_gather(t, [&] {
      torch::Tensor out = ix->cut(t, spec, cut_keys);
      const auto st = out.strides();
      const bool broadcast = std::find(st.begin(), st.end(), 0) != st.end();  // expanded on purpose (TokenIndex::cut)
      // Dense results keep the input's layout (TokenIndex cuts permuted views in memory order). A
      // contiguous input stays contiguous: some backward kernels read saved tensors as flat arrays
      // (layer norm's mean and rstd), and a sequence-first [T, B, ..] cut comes back permuted.
      if (!broadcast && (!out.is_non_overlapping_and_dense() || (t.is_contiguous() && !out.is_contiguous()))) {
        out = out.contiguous();
      }
      if (zero_padding_keys) out = ix->zero_padding_into(out, t, spec, /*keys_only=*/true);
      return out;
    });
  };
}

SavedCut::CutFn Transaction::packed_cut_fn(const ShapeSpec& spec) const {
  auto ix = ix_;
  return [ix, spec](const torch::Tensor& t) {
    check_unpacked(*ix, t, spec);
    return ix->cut_packed(t);
  };
}

SavedCut::CutFn Transaction::zero_dropped_fn(const ShapeSpec& spec) const {
  auto ix = ix_;
  return [ix, spec](const torch::Tensor& t) { return t.is_floating_point() ? ix->zero_dropped(t, spec, true) : t; };
}

void Transaction::count_gather(const torch::Tensor& t, int64_t cut_numel) {
  ++stats_.tensors_gathered;
  stats_.bytes_before += static_cast<int64_t>(t.numel() * t.element_size());
  stats_.bytes_gathered += static_cast<int64_t>(cut_numel * t.element_size());
}

}  // namespace collider::detail
