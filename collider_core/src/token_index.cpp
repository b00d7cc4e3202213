// Cutting token-shaped tensors to kept rows (see token_index.h). Each saved tensor is viewed as
// [rows, T, rest] in memory order and copied once: on the CPU by the copy kernels of
// cpu_kernels.h (parallel row copies with streaming stores for whole 64-byte lines and, for
// attention's [.., T, T] probabilities, an AVX-512 kernel packing kept columns with per-sequence
// permutation tables built here); elsewhere (CUDA, odd layouts) by index_select / gather.
// Tests: tests/test_core_token_index.cpp.
#include "token_index.h"

#include "cpu_kernels.h"

#include <collider/collider.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdint>
#include <numeric>

namespace collider::detail {

namespace {

// x's slices `idx` along `dim`: for dim 0 (token rows, the common case) one memcpy per row
// (gather_rows, index_select where the layout has no row kernel), index_select for other dims.
// Not streamed: the backward reads most of these next.
torch::Tensor select_rows(const torch::Tensor& x, int64_t dim, const torch::Tensor& idx) {
  return dim == 0 ? gather_rows(x, idx, /*stream=*/false) : x.index_select(dim, idx);
}

}  // namespace

// Ragged kept counts (RHO-1's batch_topk) use a padded layout: every row is cut to N = max_b N_b
// positions, its N_b kept ones and N - N_b of its dropped ones (the first, in sequence order), all
// in ascending order, so every kernel below works unchanged on [B, N]. The padding positions
// are excluded exactly: their incoming gradient is zeroed where gradients are born (the loss
// side), they are zeroed as attention keys (kept_only) and their dK/dV discarded (exact_query),
// so every padding row carries a zero gradient through every token-wise op and adds nothing.
// On top of it, the GEMMs of the token rows run packed (edits/packed_rows.cpp): the
// backward of every x @ W (MmBackward0, AddmmBackward0 with x the [B*T, D] token rows: q, k, v,
// o, the MLP and the LM head, most of the backward's FLOPs) runs on the S = sum_b N_b kept rows.
// The attention cores run row by row on each row's own count (row_attention.h for eager
// attention, sdpa.cpp's per_row for the fused one). Element-wise work stays padded.
// Why this layout: the per-sequence case (no padding) runs the very same code, the rewrite
// touches only the kept positions' bookkeeping and three zeroing points, and the FLOP-heavy parts
// cost what the kept tokens cost. What the padding costs: on real excess-loss selections (the
// ragged backward benchmark, now experiments/bench_backward_ragged.toml; B = 4, 40% filtered)
// tinyllama-mini rows kept [227, 325, 305, 371] of 512 (+21% element-wise rows; the attention
// cores padded to 371 did 42% more scores than sum N_b^2, which is why they run per row) and
// [516, 674, 614, 653] of 1024 (+10% rows). Measured on 2 CPU cores (results/bm_collider_backward/
// cpu-cpu-20261203-ragged-{d,f}; median of per-round ratios on a host whose rounds spread over
// +-25%), ragged rows took 1-2% longer than per-sequence rows of the same total at T = 1024 and
// -4% to +6% at T = 512 (with the cores padded: 3-10% at T = 512, up to 19% at 1024). Packing
// the element-wise ops too would need the packed and padded layouts converted where the
// attention heads' [B, H, T, E] views begin and end; not written.
TokenIndex::TokenIndex(const torch::Tensor& keep_BT) {
  if (!keep_BT.defined()) throw Error("filter_backward: the keep mask is undefined");
  if (keep_BT.dim() != 2 || keep_BT.scalar_type() != torch::kBool) {
    throw Error(fmt::format("filter_backward: the keep mask must be bool [B, T], got {} of shape {}",
                            std::string(c10::toString(keep_BT.scalar_type())), fmt::join(keep_BT.sizes(), "x")));
  }
  B_ = keep_BT.size(0);
  T_ = keep_BT.size(1);
  keep_BT_ = keep_BT;
  if (B_ == 0 || T_ == 0) throw Error("filter_backward: the keep mask is empty (B or T is 0)");
  // Per-row kept counts and the kept positions, on the host (N sizes every cut tensor). On the
  // CPU one pass over the mask (the torch ops cost ~80 us of dispatch at B = 1, T = 512).
  auto keep_cpu = keep_BT.cpu().contiguous();
  const bool* k = keep_cpu.const_data_ptr<bool>();
  counts_.assign(B_, 0);
  for (int64_t b = 0; b < B_; ++b)
    for (int64_t t = 0; t < T_; ++t) counts_[b] += k[b * T_ + t];
  N_ = *std::max_element(counts_.begin(), counts_.end());
  if (N_ == 0) {
    throw Error(
        "filter_backward: the keep mask keeps no token (True = kept), so the filtered loss has no gradient: "
        "skip this step's backward, or check that the mask is not inverted");
  }
  ragged_ = std::any_of(counts_.begin(), counts_.end(), [&](int64_t c) { return c != N_; });
  idx_BN_ = torch::empty({B_, N_}, torch::kLong);
  int64_t* idx = idx_BN_.data_ptr<int64_t>();
  torch::Tensor sel_cpu = keep_cpu;
  if (ragged_) {
    sel_cpu = keep_cpu.clone();
    pad_BN_ = torch::zeros({B_, N_}, torch::kBool);
    bool* sel = sel_cpu.data_ptr<bool>();
    bool* pad = pad_BN_.data_ptr<bool>();
    for (int64_t b = 0; b < B_; ++b) {
      int64_t missing = N_ - counts_[b];
      for (int64_t t = 0; t < T_ && missing > 0; ++t)
        if (!sel[b * T_ + t]) sel[b * T_ + t] = true, --missing;
      int64_t n = 0;
      for (int64_t t = 0; t < T_; ++t)
        if (sel[b * T_ + t]) pad[b * N_ + n++] = !k[b * T_ + t];
    }
  }
  const bool* sel = sel_cpu.const_data_ptr<bool>();
  for (int64_t b = 0; b < B_; ++b)
    for (int64_t t = 0; t < T_; ++t)
      if (sel[b * T_ + t]) *idx++ = t;
  if (ragged_) {
    // Packed rows: the live (kept) rows of the padded layout and their rows in [B*T].
    const int64_t S = kept_total();
    live_S_ = torch::empty({S}, torch::kLong);
    packed_S_ = torch::empty({S}, torch::kLong);
    int64_t* live = live_S_.data_ptr<int64_t>();
    int64_t* packed = packed_S_.data_ptr<int64_t>();
    const bool* pad = pad_BN_.const_data_ptr<bool>();
    const int64_t* pos = idx_BN_.const_data_ptr<int64_t>();
    pad_rows_ = torch::empty({B_ * N_ - S}, torch::kLong);
    int64_t* padding = pad_rows_.data_ptr<int64_t>();
    for (int64_t r = 0; r < B_ * N_; ++r) {
      if (pad[r])
        *padding++ = r;
      else
        *live++ = r, *packed++ = (r / N_) * T_ + pos[r];
    }
  }
  sel_BT_ = ragged_ ? sel_cpu.to(keep_BT.device()) : keep_BT;
  if (!keep_BT.is_cpu()) {
    idx_BN_ = idx_BN_.to(keep_BT.device());
    if (ragged_) {
      pad_BN_ = pad_BN_.to(keep_BT.device());
      live_S_ = live_S_.to(keep_BT.device());
      packed_S_ = packed_S_.to(keep_BT.device());
      pad_rows_ = pad_rows_.to(keep_BT.device());
    }
  }
  if (ragged_) {  // per row, its live slots: live_rows() is b-major, row b's run offset by b * N
    int64_t offset = 0;
    for (int64_t b = 0; b < B_; ++b) {
      live_slots_.push_back(live_S_.narrow(0, offset, counts_[b]) - b * N_);
      offset += counts_[b];
    }
  }
}

int64_t TokenIndex::kept_total() const {
  int64_t n = 0;
  for (int64_t c : counts_) n += c;
  return n;
}

TokenIndex* TokenIndex::row(int64_t b) {
  TORCH_CHECK(b >= 0 && b < B_, "collider: TokenIndex::row out of range (bug)");
  if (counts_[b] == 0) return nullptr;
  if (rows_.empty()) rows_.resize(B_);
  if (!rows_[b]) rows_[b] = std::make_unique<TokenIndex>(keep_BT_.narrow(0, b, 1));
  return rows_[b].get();
}

const torch::Tensor& TokenIndex::live_slots(int64_t b) const {
  TORCH_CHECK(ragged_, "collider: live_slots of a mask that is not ragged (bug)");
  return live_slots_.at(b);
}

torch::Tensor TokenIndex::cut_packed(const torch::Tensor& x_TP) const {
  TORCH_CHECK(ragged_ && x_TP.dim() == 2 && x_TP.size(0) == B_ * T_,
              "collider: cut_packed wants the [B*T, P] rows of a ragged mask (plan bug)");
  return gather_rows(x_TP, packed_S_, /*stream=*/false);  // read by the GEMM next (saved_cut.h)
}

torch::Tensor TokenIndex::zero_padding(const torch::Tensor& x, const ShapeSpec& spec, bool keys_only) const {
  return zero_padding_into(x, x, spec, keys_only);
}

torch::Tensor TokenIndex::zero_padding_into(torch::Tensor x, const torch::Tensor& source, const ShapeSpec& spec,
                                            bool keys_only) const {
  return zero_padding_impl(x, !x.is_alias_of(source), spec, keys_only);
}

torch::Tensor TokenIndex::zero_padding_in_place(torch::Tensor x, const ShapeSpec& spec) const {
  return zero_padding_impl(x, true, spec, false);
}

torch::Tensor TokenIndex::zero_padding_impl(torch::Tensor x, bool in_place, const ShapeSpec& spec,
                                            bool keys_only) const {
  if (!ragged_ || !x.is_floating_point()) return x;
  // in_place: after the first product, out is ours either way
  int64_t bdim = -1, mult = 1;
  for (const auto& d : spec.dims)
    if (d.kind == DimKind::kBatch) bdim = d.dim, mult = d.mult;
  torch::Tensor out = x;
  const int32_t off = spec.pad_rank > 0 ? spec.pad_rank - spec.rank : 0;
  if (spec.pad_rank > 0) bdim = spec.bcast_batch_dim, mult = spec.bcast_mult;
  auto live = (~pad_BN_).to(x.scalar_type());  // [B, N]: 0 at padding
  for (const auto& d : spec.dims) {
    // A route holds only kept tokens' rows (add_route): no padding there.
    if (d.kind == DimKind::kBatch || d.has_route() || (keys_only && d.role != Role::kKey)) continue;
    std::vector<int64_t> shape(x.dim(), 1);
    torch::Tensor f;
    const int64_t dim = d.dim + off;
    if (d.kind == DimKind::kFlatToken) {
      shape[dim] = B_ * d.mult * N_;
      f = live.repeat_interleave(d.mult, 0).reshape(shape);
    } else if (d.kind == DimKind::kFlatSeqFirst) {
      shape[dim] = B_ * d.mult * N_;
      f = live.t().repeat_interleave(d.mult, 1).reshape(shape);
    } else if (d.kind == DimKind::kFlatPerToken) {
      shape[dim] = B_ * N_ * d.mult;
      f = live.reshape({-1}).repeat_interleave(d.mult).reshape(shape);
    } else {
      f = live.repeat_interleave(mult, 0);  // [B*m, N]
      if (d.kind == DimKind::kTokenPlus) f = torch::cat({f, torch::ones({f.size(0), d.mult}, f.options())}, 1);
      if (bdim > dim) f = f.t();
      if (bdim >= 0) shape[bdim] = B_ * mult;
      shape[dim] = d.kind == DimKind::kTokenPlus ? N_ + d.mult : N_;
      f = f.reshape(shape);
    }
    out = in_place ? out.mul_(f) : out * f;
    in_place = true;
  }
  return out;
}

const TokenIndex::ChunkTables& TokenIndex::chunk_tables() {
  if (!chunks_.count.empty()) return chunks_;
  const int64_t C = (T_ + 15) / 16;
  chunks_.perm.assign(B_ * C * 16, 0);
  chunks_.count.assign(B_ * C, 0);
  chunks_.full_stores.assign(B_, 0);
  auto keep = sel_BT_.cpu().contiguous();  // the cut positions (kept + padding)
  const bool* k = keep.data_ptr<bool>();
  for (int64_t b = 0; b < B_; ++b) {
    int64_t offset = 0;  // output position of chunk c in every kept row of batch row b
    for (int64_t c = 0; c < C; ++c) {
      int32_t n = 0;
      for (int64_t j = 0; j < 16 && c * 16 + j < T_; ++j)
        if (k[b * T_ + c * 16 + j]) chunks_.perm[(b * C + c) * 16 + n++] = static_cast<int32_t>(j);
      chunks_.count[b * C + c] = n;
      if (offset + 16 <= N_) chunks_.full_stores[b] = c + 1;  // a whole 16-lane store stays in the row
      offset += n;
    }
  }
  return chunks_;
}

const torch::Tensor& TokenIndex::flat_rows(int64_t rpb) {
  auto it = flat_cache_.find(rpb);
  if (it != flat_cache_.end()) return it->second;
  auto base = torch::arange(B_ * rpb, idx_BN_.options()).mul_(T_).view({B_, rpb, 1});
  auto flat = (base + idx_BN_.view({B_, 1, N_})).reshape({-1});
  return flat_cache_.emplace(rpb, flat).first->second;
}

const torch::Tensor& TokenIndex::flat_rows_seq_first(int64_t mult) {
  auto it = seq_first_cache_.find(mult);
  if (it != seq_first_cache_.end()) return it->second;
  // out row (n*B + b)*mult + j = in row (idx[b, n]*B + b)*mult + j
  auto t_NB1 = idx_BN_.t().mul(B_ * mult).unsqueeze(2);
  auto b_1B1 = torch::arange(B_, idx_BN_.options()).mul_(mult).view({1, B_, 1});
  auto j_11M = torch::arange(mult, idx_BN_.options()).view({1, 1, mult});
  auto flat = (t_NB1 + b_1B1 + j_11M).reshape({-1}).contiguous();
  return seq_first_cache_.emplace(mult, flat).first->second;
}

const torch::Tensor& TokenIndex::flat_rows_per_token(int64_t mult) {
  auto it = per_token_cache_.find(mult);
  if (it != per_token_cache_.end()) return it->second;
  // out row (b*N + n)*mult + j = in row (b*T + idx[b, n])*mult + j
  auto j_1M = torch::arange(mult, idx_BN_.options()).view({1, mult});
  auto b_B1 = torch::arange(B_, idx_BN_.options()).mul_(T_).view({B_, 1});
  auto flat = ((b_B1 + idx_BN_).view({-1, 1}).mul(mult) + j_1M).reshape({-1}).contiguous();
  return per_token_cache_.emplace(mult, flat).first->second;
}

const torch::Tensor& TokenIndex::idx_rows(int64_t rpb) {
  auto it = rows_cache_.find(rpb);
  if (it != rows_cache_.end()) return it->second;
  auto rows = idx_BN_.view({B_, 1, N_}).expand({B_, rpb, N_}).reshape({B_ * rpb, N_});
  return rows_cache_.emplace(rpb, rows).first->second;
}

const torch::Tensor& TokenIndex::idx_square(int64_t rpb) {
  auto it = square_cache_.find(rpb);
  if (it != square_cache_.end()) return it->second;
  const auto& rows = idx_rows(rpb);  // [R, N]
  auto sq = (rows.unsqueeze(2) * T_ + rows.unsqueeze(1)).reshape({rows.size(0), N_ * N_});
  return square_cache_.emplace(rpb, sq).first->second;
}

// x: [.., B*m @batch_dim, .., T, T]: reads only the N x N kept entries of each [T, T] block,
// instead of cutting rows and then columns (attention probabilities are the largest saved
// tensors; this halves their copy traffic).
torch::Tensor TokenIndex::cut_last_two(const torch::Tensor& x_in, int64_t batch_dim) {
  torch::Tensor x = batch_dim > 0 ? x_in.movedim(batch_dim, 0) : x_in;
  auto sizes = x.sizes().vec();
  const int64_t r = static_cast<int64_t>(sizes.size());
  const int64_t rows = c10::multiply_integers(sizes.begin(), sizes.end() - 2);
  torch::Tensor out;
  if (x.is_cpu() && x.is_contiguous() && idx_BN_.is_cpu()) {
    out = torch::empty({rows, N_, N_}, x.options());
    const int64_t* idx = idx_BN_.data_ptr<int64_t>();
#if defined(__x86_64__) && defined(__GNUC__)
    if (x.element_size() == 4 && have_avx512()) {
      const auto& ct = chunk_tables();
      square_cut_avx512(static_cast<const float*>(x.const_data_ptr()), static_cast<float*>(out.data_ptr()), idx,
                        ct.perm.data(), ct.count.data(), ct.full_stores.data(), rows, rows / B_, T_, N_);
      sizes[r - 2] = N_;
      sizes[r - 1] = N_;
      out = out.view(sizes);
      return batch_dim > 0 ? out.movedim(0, batch_dim) : out;
    }
#endif
    if (!square_cut_portable(x.const_data_ptr(), out.data_ptr(), x.element_size(), idx, rows, rows / B_, T_, N_)) {
      out = torch::Tensor();  // no such CPU type today; the generic gather below
    }
  }
  if (!out.defined()) out = x.reshape({rows, T_ * T_}).gather(1, idx_square(rows / B_));
  sizes[r - 2] = N_;
  sizes[r - 1] = N_;
  out = out.view(sizes);
  return batch_dim > 0 ? out.movedim(0, batch_dim) : out;
}

// x: [.., B*m @batch_dim, .., T @token_dim, ..]; batch_dim -1 when B = 1 (every row belongs to
// the one sequence). A batch dimension after the token dimension (sequence-first [T, B, D]) is
// moved in front, which costs one copy of the whole tensor before the gather.
torch::Tensor TokenIndex::cut_dim(const torch::Tensor& x_in, int64_t batch_dim, int64_t token_dim) {
  torch::Tensor x = x_in;
  bool moved = false;
  if (batch_dim > 0) {
    x = x.movedim(batch_dim, 0);  // dims before batch_dim shift right by one
    if (token_dim < batch_dim) ++token_dim;
    moved = true;
  }
  auto sizes = x.sizes().vec();
  const int64_t rows = c10::multiply_integers(sizes.begin(), sizes.begin() + token_dim);  // B * rpb (1 if none)
  const int64_t rpb = rows / B_;
  const int64_t post = c10::multiply_integers(sizes.begin() + token_dim + 1, sizes.end());
  torch::Tensor out;
  if (post == 1) {
    out = x.reshape({rows, T_}).gather(1, idx_rows(rpb));
  } else {
    out = gather_rows(x.reshape({rows * T_, post}), flat_rows(rpb), /*stream=*/false);
  }
  sizes[token_dim] = N_;
  out = out.view(sizes);
  return moved ? out.movedim(0, batch_dim) : out;
}

static bool cut_this(const DimSpec& d, bool cut_keys) {
  return d.kind != DimKind::kBatch && (d.role == Role::kQuery || cut_keys);
}

torch::Tensor TokenIndex::cut(const torch::Tensor& x_in, const ShapeSpec& spec, bool cut_keys) {
  if (spec.has_route()) return cut_route(x_in, spec);
  // T token positions and a few fixed ones (kTokenPlus): the token positions cut, the fixed ones kept.
  for (size_t k = 0; k < spec.dims.size(); ++k) {
    const DimSpec& d = spec.dims[k];
    if (d.kind != DimKind::kTokenPlus) continue;
    TORCH_CHECK(spec.pad_rank == 0, "collider: a broadcast tensor with fixed positions after its tokens (plan bug)");
    ShapeSpec rest = spec;
    rest.dims.erase(rest.dims.begin() + static_cast<std::ptrdiff_t>(k));
    if (!cut_this(d, cut_keys)) return cut(x_in, rest, cut_keys);
    ShapeSpec tokens = spec;
    tokens.dims[k].kind = DimKind::kToken;
    tokens.dims[k].mult = 1;
    return torch::cat(
        {cut(x_in.narrow(d.dim, 0, T_), tokens, cut_keys), cut(x_in.narrow(d.dim, T_, d.mult), rest, cut_keys)}, d.dim);
  }
  torch::Tensor x = x_in;
  int64_t bdim = -1;
  int32_t off = 0;
  if (spec.pad_rank > 0) {
    off = spec.pad_rank - spec.rank;
    auto shape = std::vector<int64_t>(off, 1);
    for (auto s : x.sizes()) shape.push_back(s);
    x = x.reshape(shape);
    shape[spec.bcast_batch_dim] = B_ * spec.bcast_mult;
    x = x.expand(shape);
    bdim = spec.bcast_batch_dim;
  } else {
    for (const auto& d : spec.dims)
      if (d.kind == DimKind::kBatch) bdim = d.dim;
  }
  // Attention's [.., Tq, Tk] cut on both: one pass.
  const int32_t rank = spec.pad_rank > 0 ? spec.pad_rank : spec.rank;
  std::vector<const DimSpec*> cuts;
  for (const auto& d : spec.dims)
    if (cut_this(d, cut_keys)) cuts.push_back(&d);
  // Broadcast (stride-0) dimensions that no cut touches: cut one slice and expand it back.
  // GQA's keys and values are saved expanded from G to H heads; copying H / G identical
  // copies of them would be wasted work (and memory). Not for the batch dimension when B > 1,
  // whose rows keep different tokens.
  if (spec.pad_rank == 0) {
    std::vector<int64_t> full;
    for (int64_t d = 0; d < x.dim(); ++d) {
      if (x.stride(d) != 0 || x.size(d) == 1 || (d == bdim && B_ > 1)) continue;
      bool cut_here = false;
      for (const auto* c : cuts) cut_here = cut_here || c->dim == d;
      if (cut_here) continue;
      if (full.empty()) full = x.sizes().vec();
      x = x.narrow(d, 0, 1);
    }
    if (!full.empty()) {
      auto out = cut(x, spec, cut_keys);
      auto want = cut_sizes(full, spec, cut_keys);
      return out.expand(want);
    }
  }
  if (cuts.size() == 2 && cuts[0]->kind == DimKind::kToken && cuts[1]->kind == DimKind::kToken &&
      cuts[0]->dim + off == rank - 2 && cuts[1]->dim + off == rank - 1 && (bdim >= 0 || B_ == 1) && bdim < rank - 2 &&
      x.size(rank - 1) == T_ && x.size(rank - 2) == T_) {
    return cut_last_two(x, bdim);
  }
  if (spec.pad_rank == 0 && !x.is_contiguous()) {
    if (auto out = cut_in_memory_order(x, spec, cut_keys); out.defined()) return out;
  }
  for (const auto& d : spec.dims) {
    if (!cut_this(d, cut_keys)) continue;
    if (d.flat()) {
      const auto& rows = d.kind == DimKind::kFlatToken      ? flat_rows(d.mult)
                         : d.kind == DimKind::kFlatSeqFirst ? flat_rows_seq_first(d.mult)
                                                            : flat_rows_per_token(d.mult);
      x = select_rows(x, d.dim + off, rows);
    } else {
      TORCH_CHECK(bdim >= 0 || B_ == 1, "collider: token dimension without a batch dimension (plan bug)");
      x = cut_dim(x, bdim, d.dim + off);
    }
  }
  return x;
}

// A permuted view of contiguous memory (attention's q/k/v as [B, H, T, E] views of [B, T, H, E]):
// cut it as the contiguous tensor it is a view of and permute the result back, so the kept
// rows are copied once, in memory order, and the result keeps the input's layout (reshaping
// the view first would copy the whole tensor before the gather). Undefined when the layout
// does not allow it (not a permutation of contiguous memory, or the batch dimension not
// outside every cut dimension).
torch::Tensor TokenIndex::cut_in_memory_order(const torch::Tensor& x, const ShapeSpec& spec, bool cut_keys) {
  const int64_t r = x.dim();
  std::vector<int64_t> perm(r);  // memory order: outermost (largest stride) first
  std::iota(perm.begin(), perm.end(), 0);
  std::stable_sort(perm.begin(), perm.end(), [&](int64_t a, int64_t b) { return x.stride(a) > x.stride(b); });
  auto xp = x.permute(perm);
  if (!xp.is_contiguous()) return {};
  std::vector<int32_t> pos(r);  // pos[original dim] = its place in memory order
  for (int64_t i = 0; i < r; ++i) pos[perm[i]] = static_cast<int32_t>(i);
  ShapeSpec sp = spec;
  for (auto& d : sp.dims) d.dim = pos[d.dim];
  std::sort(sp.dims.begin(), sp.dims.end(), [](const DimSpec& a, const DimSpec& b) { return a.dim < b.dim; });
  int32_t bdim = -1;
  for (const auto& d : sp.dims)
    if (d.kind == DimKind::kBatch) bdim = d.dim;
  for (const auto& d : sp.dims) {
    if (!cut_this(d, cut_keys)) continue;
    if (d.kind == DimKind::kToken && bdim > d.dim) return {};         // batch inside a token dim
    if (d.kind == DimKind::kToken && bdim < 0 && B_ != 1) return {};  // no batch dim to index by
  }
  auto out = cut(xp, sp, cut_keys);
  std::vector<int64_t> inv(r);
  for (int64_t i = 0; i < r; ++i) inv[i] = pos[i];
  return out.permute(inv);
}

torch::Tensor TokenIndex::uncut(const torch::Tensor& x, const ShapeSpec& spec, bool cut_keys,
                                c10::IntArrayRef full_sizes) {
  // Where each element of the cut sits in the full tensor: the cut of the full tensor's element
  // numbers (int64, so this costs 8 bytes per full element; used for leaves, which are rare).
  auto where = cut(torch::arange(c10::multiply_integers(full_sizes), x.options().dtype(torch::kLong)).view(full_sizes),
                   spec, cut_keys);
  TORCH_CHECK(where.sizes() == x.sizes(), "collider: a leaf's gradient is [", x.sizes(), "], its cut layout [",
              where.sizes(), "]");
  auto full = torch::zeros(full_sizes, x.options());
  if (!ragged_) {
    full.view(-1).index_put_({where.reshape(-1)}, x.reshape(-1));
    return full;
  }
  // Ragged: a padding slot of the cut repeats a kept position; its gradient zeroed and the writes
  // summed, the kept position gets its own value whichever write comes last.
  full.view(-1).index_put_({where.reshape(-1)}, zero_padding(x, spec, /*keys_only=*/false).reshape(-1),
                           /*accumulate=*/true);
  return full;
}

torch::Tensor TokenIndex::zero_dropped(const torch::Tensor& x, const ShapeSpec& spec, bool keys_too) {
  TORCH_CHECK(spec.pad_rank == 0, "collider: masking a broadcast tensor is not supported");
  int64_t bdim = -1, mult = 1;
  for (const auto& d : spec.dims)
    if (d.kind == DimKind::kBatch) bdim = d.dim, mult = d.mult;
  torch::Tensor out = x;
  auto keep = keep_BT_.to(x.scalar_type());
  for (const auto& d : spec.dims) {
    if (!cut_this(d, keys_too) || d.has_route()) continue;  // a route's rows are zero when their tokens' are
    std::vector<int64_t> shape(x.dim(), 1);
    torch::Tensor f;
    if (d.kind == DimKind::kFlatToken) {
      shape[d.dim] = B_ * d.mult * T_;
      f = keep.repeat_interleave(d.mult, 0).reshape(shape);
    } else if (d.kind == DimKind::kFlatSeqFirst) {
      shape[d.dim] = B_ * d.mult * T_;
      f = keep.t().repeat_interleave(d.mult, 1).reshape(shape);  // [T, B*m] in row order
    } else if (d.kind == DimKind::kFlatPerToken) {
      shape[d.dim] = B_ * T_ * d.mult;
      f = keep.reshape({-1}).repeat_interleave(d.mult).reshape(shape);
    } else {
      TORCH_CHECK(bdim >= 0 || B_ == 1, "collider: masking needs a batch dimension (plan bug)");
      f = keep.repeat_interleave(mult, 0);  // [B*m, T]
      if (d.kind == DimKind::kTokenPlus) f = torch::cat({f, torch::ones({f.size(0), d.mult}, f.options())}, 1);
      if (bdim > d.dim) f = f.t();  // sequence-first: [T, B*m]
      if (bdim >= 0) shape[bdim] = B_ * mult;
      shape[d.dim] = d.kind == DimKind::kTokenPlus ? T_ + d.mult : T_;
      f = f.reshape(shape);
    }
    out = out * f;
  }
  return out;
}

std::vector<int64_t> TokenIndex::cut_sizes(c10::IntArrayRef sizes, const ShapeSpec& spec, bool cut_keys) const {
  std::vector<int64_t> out;
  int32_t off = 0;
  if (spec.pad_rank > 0) {
    off = spec.pad_rank - spec.rank;
    out.assign(off, 1);
  }
  out.insert(out.end(), sizes.begin(), sizes.end());
  if (spec.pad_rank > 0) out[spec.bcast_batch_dim] = B_ * spec.bcast_mult;
  for (const auto& d : spec.dims) {
    if (!cut_this(d, cut_keys) || d.kind == DimKind::kRoutedOffsets) continue;
    out[d.dim + off] = d.routed()                                   ? route(d.route).kept_K.size(0)
                       : d.flat() || d.kind == DimKind::kTokenSlots ? B_ * d.mult * N_
                       : d.kind == DimKind::kTokenPlus              ? N_ + d.mult
                                                                    : N_;
  }
  return out;
}

std::string TokenIndex::mismatch(c10::IntArrayRef sizes, const ShapeSpec& spec) const {
  if (static_cast<int32_t>(sizes.size()) != spec.rank) {
    return fmt::format("rank {} where the plan has {}", sizes.size(), spec.rank);
  }
  for (const auto& d : spec.dims) {
    if (d.kind == DimKind::kRoutedOffsets) continue;  // one per expert
    if (d.routed() && !routes_.count(d.route)) return fmt::format("route #{} was not read (plan bug)", d.route);
    const int64_t want = d.routed()                                   ? route(d.route).rows
                         : d.kind == DimKind::kToken                  ? T_
                         : d.kind == DimKind::kTokenPlus              ? T_ + d.mult
                         : d.flat() || d.kind == DimKind::kTokenSlots ? B_ * d.mult * T_
                                                                      : B_ * d.mult;
    if (sizes[d.dim] != want) {
      return fmt::format("size {} at dimension {} where the plan expects {} (B={}, T={})", sizes[d.dim], d.dim, want,
                         B_, T_);
    }
  }
  return {};
}

void TokenIndex::add_route(int32_t id, const torch::Tensor& positions_R) {
  if (positions_R.dim() != 1 || positions_R.scalar_type() != torch::kLong) {
    throw Error(fmt::format("filter_backward: the index of mixture-of-experts route #{} is not int64 [R]", id));
  }
  Route r;
  r.rows = positions_R.size(0);
  r.positions_R = positions_R;
  const auto dev = positions_R.device();
  if (r.rows > 0) {
    const int64_t lo = positions_R.min().item<int64_t>(), hi = positions_R.max().item<int64_t>();
    if (lo < 0 || hi >= B_ * T_) {
      throw Error(fmt::format(
          "filter_backward: the index of mixture-of-experts route #{} holds rows {}..{}, outside the {} token rows "
          "of the keep mask's [B, T] = [{}, {}]; the mask must be the hidden states' [B, T]",
          id, lo, hi, B_ * T_, B_, T_));
    }
  }
  build_cut_rows(dev);
  r.kept_K = keep_M_.index_select(0, positions_R).nonzero().squeeze(1);
  r.cut_positions_K = cut_row_M_.index_select(0, positions_R.index_select(0, r.kept_K));
  routes_[id] = std::move(r);
}

void TokenIndex::add_sorted_route(int32_t id, const torch::Tensor& inverse_S, int64_t slots) {
  const int64_t S = B_ * T_ * slots;
  if (inverse_S.dim() != 1 || inverse_S.scalar_type() != torch::kLong || inverse_S.size(0) != S || slots < 1) {
    throw Error(
        fmt::format("filter_backward: the sorted order of grouped experts #{} is not int64 [B*T*k] = [{}]", id, S));
  }
  // The inverse of a permutation of [S]: every route row exactly once.
  if (!torch::bincount(inverse_S, {}, S).eq(1).all().item<bool>()) {
    throw Error(fmt::format("filter_backward: the sorted order of grouped experts #{} is not a permutation", id));
  }
  auto perm_S = torch::empty_like(inverse_S);
  perm_S.index_put_({inverse_S}, torch::arange(S, inverse_S.options()));
  add_route(id, perm_S.div(slots, "floor"));
  Route& r = routes_.at(id);
  r.kept_before_R1 = torch::cat(
      {torch::zeros({1}, inverse_S.options()), keep_M_.index_select(0, r.positions_R).to(torch::kLong).cumsum(0)});
}

// Row of [B*T] -> row of the cut [B*N] (-1 where cut away), built once for every route.
void TokenIndex::build_cut_rows(torch::Device device) {
  if (cut_row_M_.defined()) return;
  auto rows_BN = (torch::arange(B_, torch::kLong) * T_).unsqueeze(1) + idx_BN_.cpu();
  cut_row_M_ = torch::full({B_ * T_}, -1, torch::kLong);
  cut_row_M_.index_put_({rows_BN.reshape(-1)}, torch::arange(B_ * N_, torch::kLong));
  cut_row_M_ = cut_row_M_.to(device);
  keep_M_ = keep_BT_.reshape(-1).to(device);
  rows_BN_ = rows_BN.reshape(-1).to(device);
}

void TokenIndex::add_hooked_route(int32_t id, torch::Device device) {
  build_cut_rows(device);
  hooked_routes_.insert(id);
}

torch::Tensor TokenIndex::cut_rows_of(const torch::Tensor& positions_R) const {
  TORCH_CHECK(cut_row_M_.defined(), "collider: no mixture-of-experts route was registered (plan bug)");
  TORCH_CHECK(positions_R.dim() == 1 && positions_R.scalar_type() == torch::kLong,
              "collider: the index of a mixture-of-experts route is not int64 [R]");
  return cut_row_M_.index_select(0, positions_R.to(cut_row_M_.device()));
}

const TokenIndex::Route& TokenIndex::route(int32_t id) const {
  auto it = routes_.find(id);
  TORCH_CHECK(it != routes_.end(), "collider: mixture-of-experts route #", id, " was not read (plan bug)");
  return it->second;
}

bool TokenIndex::is_route_index(const torch::Tensor& x, const ShapeSpec& spec) const {
  for (const auto& d : spec.dims) {
    if (d.kind != DimKind::kRoutedPositions && d.kind != DimKind::kRoutedSlots) continue;
    const Route& r = route(d.route);
    if (x.dim() != 1 || x.scalar_type() != torch::kLong || x.size(0) != r.rows) return false;
    const torch::Tensor rows = d.kind == DimKind::kRoutedSlots ? x.div(d.mult, "floor") : x;
    if (!torch::equal(rows, r.positions_R)) return false;
  }
  return true;
}

// Token slots t*mult + j -> the same slots of the cut [B*N] rows (-1 rows where the token was cut away).
torch::Tensor TokenIndex::cut_rows_of_slots(const torch::Tensor& slots, int64_t mult) const {
  return cut_rows_of(slots.div(mult, "floor")) * mult + slots.remainder(mult);
}

torch::Tensor TokenIndex::hooked_route_values(const torch::Tensor& x, const ShapeSpec& spec) const {
  for (const auto& d : spec.dims) {
    if (d.kind == DimKind::kRoutedPositions) return cut_rows_of(x).clamp_min(0);
    if (d.kind == DimKind::kRoutedSlots) {
      return cut_rows_of(x.div(d.mult, "floor")).clamp_min(0) * d.mult + x.remainder(d.mult);
    }
  }
  return x;
}

// A field of a route (routes.h): the route's kept rows; an index of token rows becomes the kept
// rows' places in the cut [B*N] token rows, offsets count kept rows, token slots point at the kept
// rows. trace_plan gives such a field no other token dimension. A hooked route (not cut) reaches
// here only for its offsets (kept) and its token slots (cut to the cut token rows).
torch::Tensor TokenIndex::cut_route(const torch::Tensor& x, const ShapeSpec& spec) const {
  for (const auto& d : spec.dims) {
    if (!d.has_route()) continue;
    const bool hooked = hooked_route(d.route);
    switch (d.kind) {
      case DimKind::kRouted: {
        // An expert's token rows ([rows, D] saved inputs and gradients, the common case).
        return select_rows(x, d.dim, route(d.route).kept_K.to(x.device()));
      }
      case DimKind::kRoutedPositions:
        return route(d.route).cut_positions_K;
      case DimKind::kRoutedSlots:
        return cut_rows_of_slots(x.index_select(0, route(d.route).kept_K.to(x.device())), d.mult);
      case DimKind::kRoutedOffsets:
        if (hooked) return x;
        return route(d.route).kept_before_R1.index_select(0, x.to(torch::kLong)).to(x.scalar_type());
      case DimKind::kTokenSlots: {
        const auto slots = x.reshape({B_ * T_, d.mult}).index_select(0, rows_BN_.to(x.device())).reshape(-1);
        if (hooked) return slots;
        // A kept row's place: the kept rows before it. A padding row's slots are a dropped token's:
        // any kept row will do, its gradient is zero (the last).
        const Route& r = route(d.route);
        return r.kept_before_R1.index_select(0, slots).clamp_max(r.kept_K.size(0) - 1);
      }
      default:
        break;
    }
  }
  return x;
}

}  // namespace collider::detail
