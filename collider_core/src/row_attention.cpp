// Ragged kept counts under eager attention: an attention core's backward one sequence row at a
// time (see row_attention.h). Tested by tests/test_collider_ragged.cpp against the oracles.
//
// Why per row: the padded layout (token_index.cpp) cuts every row to N = max_b N_b, so an eager
// core's backward (two batched matmul backwards and the softmax backward on [B*H, N, N]) works on
// B N^2 probabilities where the kept tokens have sum_b N_b^2. On real excess-loss selections
// (tinyllama-mini, B = 4, 40% filtered, rows [227, 325, 305, 371] of 512) that is 42% more; the
// core's ops alone (bmm, masked_fill, softmax, bmm; their backward timed with torch, 2 CPU cores,
// fp32, 8 heads of 64) took 26.1 ms per layer padded to 371 against 19.4 ms row by row. Row by
// row, every GEMM is [H, N_b, N_b] and nothing is padded; in the whole backward the ragged rows
// went from 3-10% over per-sequence ones to within a few percent
// (results/bm_collider_backward/README.md, "Ragged kept counts").
// The row's probabilities, Q, K^T and V are cut from the forward's full tensors with the row's
// own index (the fast per-sequence cut kernels) when the node's backward first runs, as every
// other saved tensor is cut (saved_cut.h): cut in filter_backward instead, the rewrite took 27-44
// ms of tinyllama-mini's T 1024, B 4 step and the step held every layer's full tensors and their
// cuts at once. Only the small [H, N_b, E] gradients move between the padded layout and the row
// (index_select / index_copy_ of the live slots).
//
// What it replays, per row b with kept positions K_b (queries) and keys K_b (kept_only) or all T
// (exact_query), from the saved tensors of the core's nodes:
//   dV = P^T dO; dP = dO V^T; dS = softmax backward (P, dP); dS through the score chain's scales
//   and casts; dQ = dS (K^T)^T; d(K^T) = Q^T dS
// which is what BmmBackward0, SoftmaxBackward0, MulBackward / DivBackward and ToCopyBackward0 do.
// Masks in the score chain (masked_fill, where, an added mask) are not replayed: a masked score
// enters the softmax as -inf or the dtype's lowest value (our models, transformers), so its
// probability is exactly 0 and so is dS = P (dP - rowsum(dP P)) there; the mask's backward
// has nothing left to zero. Any other op in the chains keeps the core on the padded path.
#include "row_attention.h"

#include "node_traits.h"

#include <collider/collider.h>

#include <torch/csrc/autograd/generated/Functions.h>

#include <fmt/format.h>

#include <set>

namespace collider::detail {
namespace {

namespace gen = torch::autograd::generated;
using torch::autograd::Node;
using torch::autograd::variable_list;

// The one next edge of `n` that carries a gradient; -1 when none or several do.
int single_edge(const Node& n) {
  int found = -1;
  for (size_t e = 0; e < n.next_edges().size(); ++e) {
    if (!n.next_edges()[e].function) continue;
    if (found >= 0) return -1;
    found = static_cast<int>(e);
  }
  return found;
}

bool is_shape_only(const std::string& t) { return traits_of(t).shape_only; }

// An expand to the sizes it already had: the identity.
bool identity_expand(const NodePtr& n) {
  auto* e = dynamic_cast<gen::ExpandBackward0*>(n.get());
  if (!e) return false;
  const auto& shape = n->input_metadata(0).shape_as_dim_vector();
  if (shape.size() != e->self_sym_sizes.size()) return false;
  for (size_t i = 0; i < shape.size(); ++i)
    if (shape[i] != e->self_sym_sizes[i]) return false;
  return true;
}

torch::Tensor one_element(const torch::Tensor& t) {
  if (!t.defined() || t.numel() != 1) return {};
  return t.detach().reshape({});
}

// One step of the score chain (softmax -> QK^T), or false when the stand-in cannot replay it.
bool chain_step(const NodePtr& n, const std::string& type, std::vector<RowAttentionNode::Scale>& out,
                std::string* why) {
  using Scale = RowAttentionNode::Scale;
  const int edge = single_edge(*n);
  if (edge < 0) {
    *why = fmt::format("{} passes gradient to more than one input", type);
    return false;
  }
  if (is_shape_only(type) || type == "MaskedFillBackward0" || type == "WhereBackward0" || type == "AddBackward1") {
    return true;
  }
  if (type == "ExpandBackward0") {
    if (identity_expand(n)) return true;
    *why = "a broadcasting expand in the score chain";
    return false;
  }
  if (type == "AddBackward0") {
    auto* a = dynamic_cast<gen::AddBackward0*>(n.get());
    if (edge == 1) out.push_back({Scale::kMul, at::scalar_tensor(a->alpha, torch::kDouble), {}});
    return true;
  }
  if (type == "ToCopyBackward0") {
    out.push_back({Scale::kCast, {}, c10::typeMetaToScalarType(dynamic_cast<gen::ToCopyBackward0*>(n.get())->self_options.dtype())});
    return true;
  }
  if (type == "MulBackward1") {
    out.push_back({Scale::kMul, at::scalar_tensor(dynamic_cast<gen::MulBackward1*>(n.get())->other, torch::kDouble), {}});
    return true;
  }
  if (type == "DivBackward1") {
    out.push_back({Scale::kDiv, at::scalar_tensor(dynamic_cast<gen::DivBackward1*>(n.get())->other, torch::kDouble), {}});
    return true;
  }
  if (type == "MulBackward0" || type == "DivBackward0") {
    auto* m = dynamic_cast<gen::MulBackward0*>(n.get());
    auto* d = dynamic_cast<gen::DivBackward0*>(n.get());
    if ((m && (m->other_.has_hooks() || m->self_.has_hooks())) || (d && d->other_.has_hooks())) {
      *why = fmt::format("{} saves its factor behind saved-tensor hooks", type);
      return false;
    }
    torch::Tensor f;
    if (m) f = one_element((edge == 0 ? m->other_ : m->self_).unpack(n));
    if (d && edge == 0) f = one_element(d->other_.unpack(n));
    if (!f.defined()) {
      *why = fmt::format("{} by a tensor that is not one number", type);
      return false;
    }
    out.push_back({type == "MulBackward0" ? Scale::kMul : Scale::kDiv, f, {}});
    return true;
  }
  *why = fmt::format("{} in the score chain", type);
  return false;
}

// [B*H, T, ..] with the batch dimension first: H, the rows per sequence; 0 otherwise.
int64_t heads_of(const FieldSpec* f) {
  if (!f || f->shape.pad_rank != 0 || f->shape.rank != 3) return 0;
  for (const auto& d : f->shape.dims)
    if (d.kind == DimKind::kBatch) return d.dim == 0 ? d.mult : 0;
  return 0;
}

}  // namespace

NodePtrOf<RowAttentionNode> make_row_attention(const Graph& g, const PlanData& plan,
                                                     const AttentionCoreNodes& core, TokenIndex& ix,
                                                     const std::shared_ptr<TokenIndex>& shared_index, bool exact,
                                                     std::string* why) {
  auto type = [&](int i) -> const std::string& { return plan.nodes[i].type; };
  if (core.qk < 0 || core.pv < 0) {
    *why = "not a recognised core";
    return nullptr;
  }
  // Every node of the core but PV must die with the stand-in: one parent each, inside the core.
  bool shared = g.parents[core.qk].size() != 1 || g.parents[core.softmax].size() != 1;
  for (int c : core.down) shared = shared || g.parents[c].size() != 1;
  if (shared) {
    *why = "the scores or probabilities are used outside the core";
    return nullptr;
  }
  auto* sm = dynamic_cast<gen::SoftmaxBackward0*>(g.nodes[core.softmax].get());
  auto* qk = dynamic_cast<gen::BmmBackward0*>(g.nodes[core.qk].get());
  auto* pv = dynamic_cast<gen::BmmBackward0*>(g.nodes[core.pv].get());
  if (!sm || !qk || !pv) {
    *why = "unexpected node classes";
    return nullptr;
  }
  // Tensors behind saved-tensor hooks (checkpointing, offloading) exist only in the backward; the
  // padded path cuts them there (saved_cut.h).
  if (pv->self_.has_hooks() || pv->mat2_.has_hooks() || qk->self_.has_hooks() || qk->mat2_.has_hooks() ||
      sm->result_.has_hooks()) {
    *why = "its saved tensors are behind saved-tensor hooks";
    return nullptr;
  }
  std::vector<RowAttentionNode::Scale> chain;
  for (int c : core.down)
    if (!chain_step(g.nodes[c], type(c), chain, why)) return nullptr;
  for (int c : core.up) {
    if (single_edge(*g.nodes[c]) < 0 || !(is_shape_only(type(c)) || traits_of(type(c)).cast ||
                                          (type(c) == "ExpandBackward0" && identity_expand(g.nodes[c])))) {
      *why = fmt::format("{} between softmax and P V", type(c));
      return nullptr;
    }
  }
  const NodeSpec &pv_spec = plan.nodes[core.pv], &qk_spec = plan.nodes[core.qk];
  const FieldSpec *p_f = pv_spec.find(FieldKind::kSaved, 0, "self_"), *v_f = pv_spec.find(FieldKind::kSaved, 0, "mat2_"),
                  *q_f = qk_spec.find(FieldKind::kSaved, 0, "self_"), *k_f = qk_spec.find(FieldKind::kSaved, 0, "mat2_");
  const FieldSpec* pv_input = pv_spec.find(FieldKind::kInputMeta, 0);
  const int64_t H = heads_of(p_f);
  if (H == 0 || heads_of(v_f) != H || heads_of(q_f) != H || heads_of(k_f) != H || !pv_input) {
    *why = "the matmuls' operands are not [B*H, T, ..]";
    return nullptr;
  }
  torch::Tensor p = pv->self_.unpack(g.nodes[core.pv]), v = pv->mat2_.unpack(g.nodes[core.pv]);
  torch::Tensor q = qk->self_.unpack(g.nodes[core.qk]), k_t = qk->mat2_.unpack(g.nodes[core.qk]);
  torch::Tensor r = sm->result_.unpack(g.nodes[core.softmax]);
  if (!p.defined() || !v.defined() || !q.defined() || !k_t.defined() || !r.defined() || p.dim() != 3 ||
      p.size(0) != ix.B() * H || r.numel() != p.numel() || (sm->dim != -1 && sm->dim != r.dim() - 1)) {
    *why = "the saved probabilities are not [B*H, T, T] with softmax over the last dimension";
    return nullptr;
  }
  RowAttentionNode::Saved saved;
  const bool r_is_p = r.scalar_type() == p.scalar_type() && r.data_ptr() == p.data_ptr();
  saved.p = p.detach();
  if (!r_is_p) saved.r = r.detach().reshape(p.sizes());
  saved.v = v.detach();
  saved.q = q.detach();
  saved.k_t = k_t.detach();
  saved.p_shape = p_f->shape;
  saved.v_shape = v_f->shape;
  saved.q_shape = q_f->shape;
  saved.k_shape = k_f->shape;
  for (const auto* t : {&p, &r, &v, &q, &k_t}) saved.versions.push_back(t->_version());
  auto node = make_node<RowAttentionNode>(shared_index, std::move(saved), std::move(chain), sm->self_scalar_type, H,
                                                 exact, g.nodes[core.qk], g.nodes[core.pv]);
  const auto& meta = g.nodes[core.pv]->input_metadata(0);
  std::vector<int64_t> full;
  for (const auto& d : meta.shape_as_dim_vector()) full.push_back(d.expect_int());
  auto shape = ix.cut_sizes(full, pv_input->shape, !exact);
  node->add_input_metadata(meta.options(), std::vector<c10::SymInt>(shape.begin(), shape.end()), false, false,
                           std::nullopt);
  return node;
}

RowAttentionNode::RowAttentionNode(std::shared_ptr<TokenIndex> index, Saved saved, std::vector<Scale> chain,
                                   c10::ScalarType softmax_input_dtype, int64_t heads, bool exact,
                                   NodePtr qk, NodePtr pv)
    : Node(pv->sequence_nr()),
      ix_(std::move(index)),
      saved_(std::move(saved)),
      chain_(std::move(chain)),
      softmax_input_dtype_(softmax_input_dtype),
      H_(heads),
      exact_(exact),
      qk_(std::move(qk)),
      pv_(std::move(pv)) {}

std::vector<int64_t> RowAttentionNode::cut_bytes() const {
  std::vector<int64_t> out;
  const bool cut_keys = !exact_;
  for (int64_t b = 0; b < ix_->B(); ++b) {
    const TokenIndex* rb = ix_->row(b);
    if (!rb) continue;
    for (const auto& [t, shape] : saved_.held()) {
      if (!t->defined()) continue;
      int64_t n = 1;
      for (int64_t s : rb->cut_sizes(t->narrow(0, b * H_, H_).sizes(), *shape, cut_keys)) n *= s;
      out.push_back(n * static_cast<int64_t>(t->element_size()));
    }
  }
  return out;
}

void RowAttentionNode::cut_rows() {
  const auto held = saved_.held();
  for (size_t i = 0; i < held.size(); ++i) {
    const torch::Tensor& t = *held[i].first;
    if (t.defined() && t._version() != saved_.versions[i]) {
      throw Error(fmt::format(
          "collider: a tensor saved for the attention backward was modified in place after filter_backward "
          "(version {} -> {}); call filter_backward right before loss.backward()",
          saved_.versions[i], t._version()));
    }
  }
  const bool cut_keys = !exact_;
  rows_.assign(ix_->B(), Row{});
  for (int64_t b = 0; b < ix_->B(); ++b) {
    TokenIndex* rb = ix_->row(b);
    if (!rb) continue;  // keeps nothing: no gradient from this row
    Row& row = rows_[b];
    row.live = ix_->live_slots(b);
    torch::Tensor* cut[] = {&row.p, &row.r, &row.v, &row.q, &row.k_t};  // in held()'s order
    for (size_t i = 0; i < held.size(); ++i) {
      const auto& [t, shape] = held[i];
      if (t->defined()) *cut[i] = rb->cut(t->narrow(0, b * H_, H_), *shape, cut_keys);
    }
    if (!row.r.defined()) row.r = row.p;  // r is p: one cut serves both
  }
  saved_ = {};  // the full tensors go now (a retained graph keeps the rows)
}

void RowAttentionNode::adopt_edges() {
  next_edges_ = {qk_->next_edge(0), qk_->next_edge(1), pv_->next_edge(1)};
  topological_nr_ = pv_->topological_nr();
  qk_.reset();  // the replaced nodes are not needed any more
  pv_.reset();
}

variable_list RowAttentionNode::apply(variable_list&& grads) {
  torch::Tensor dO = grads.at(0);  // [B*H, N, E], padded layout
  if (!dO.defined()) return {torch::Tensor(), torch::Tensor(), torch::Tensor()};
  if (released_) {
    throw Error(
        "collider: backward through a filtered graph a second time; its saved tensors are freed "
        "(pass retain_graph=true to the first backward)");
  }
  torch::NoGradGuard no_grad;
  if (rows_.empty()) cut_rows();
  const int64_t B = ix_->B(), N = ix_->N(), T = ix_->T(), E = dO.size(2), H = H_;
  const Row* any = nullptr;
  for (const auto& r : rows_)
    if (r.p.defined()) any = &r;
  const int64_t keys = exact_ ? T : N;
  auto dq = torch::zeros({B * H, N, E}, dO.options().dtype(any->q.scalar_type()));
  auto dk_t = torch::zeros({B * H, any->k_t.size(1), keys}, dO.options().dtype(any->k_t.scalar_type()));
  auto dv = torch::zeros({B * H, keys, any->v.size(2)}, dO.options().dtype(any->v.scalar_type()));
  for (int64_t b = 0; b < B; ++b) {
    const Row& r = rows_[b];
    if (!r.p.defined()) continue;
    auto dO_b = dO.narrow(0, b * H, H).index_select(1, r.live).to(r.p.scalar_type());  // [H, N_b, E]
    auto dv_b = at::bmm(r.p.transpose(1, 2), dO_b);                               // [H, keys_b, E]
    auto dp_b = at::bmm(dO_b, r.v.transpose(1, 2)).to(r.r.scalar_type());         // [H, N_b, keys_b]
    auto ds_b = at::_softmax_backward_data(dp_b, r.r, 2, softmax_input_dtype_);
    for (const auto& s : chain_) {
      if (s.kind == Scale::kMul) ds_b = ds_b * s.factor;
      if (s.kind == Scale::kDiv) ds_b = ds_b / s.factor;
      if (s.kind == Scale::kCast) ds_b = ds_b.to(s.dtype);
    }
    ds_b = ds_b.to(r.q.scalar_type());
    auto dq_b = at::bmm(ds_b, r.k_t.transpose(1, 2));    // [H, N_b, E]
    auto dk_t_b = at::bmm(r.q.transpose(1, 2), ds_b);    // [H, E, keys_b]
    dq.narrow(0, b * H, H).index_copy_(1, r.live, dq_b);
    if (exact_) {  // every key: cut to the kept ones (padding discarded) by the key-row node after this
      dk_t.narrow(0, b * H, H).copy_(dk_t_b);
      dv.narrow(0, b * H, H).copy_(dv_b);
    } else {
      dk_t.narrow(0, b * H, H).index_copy_(2, r.live, dk_t_b.to(dk_t.scalar_type()));
      dv.narrow(0, b * H, H).index_copy_(1, r.live, dv_b.to(dv.scalar_type()));
    }
  }
  return {dq, dk_t, dv};
}

}  // namespace collider::detail
