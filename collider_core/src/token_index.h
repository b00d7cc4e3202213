// Internal: cutting token-shaped tensors and size lists to the kept rows of a keep mask.
// One TokenIndex per filter_backward call; index tensors are built once and cached.
// Legend: B batch, T sequence, N kept per sequence, R rows = B * (rows per batch).
#pragma once

#include "plan_impl.h"

#include <torch/torch.h>

#include <map>
#include <set>
#include <memory>
#include <vector>

namespace collider::detail {

class TokenIndex {
 public:
  TokenIndex(const torch::Tensor& keep_BT);  // validates: bool [B, T], at least one kept token

  int64_t B() const { return B_; }
  int64_t T() const { return T_; }
  int64_t N() const { return N_; }  // positions per row after the cut: max over rows of the kept count
  const torch::Tensor& keep_BT() const { return keep_BT_; }  // the mask as given
  // Ragged kept counts: rows keep different numbers of tokens and are padded to N (see the .cpp).
  bool ragged() const { return ragged_; }
  const std::vector<int64_t>& kept_counts() const { return counts_; }  // [B]
  int64_t kept_total() const;
  const torch::Tensor& idx_BN() const { return idx_BN_; }  // int64 [B, N]: the cut positions, ascending
  const torch::Tensor& pad_BN() const { return pad_BN_; }  // bool [B, N]: padding; undefined unless ragged
  // Ragged masks, packed rows (S = kept_total): live_rows() int64 [S], the rows of the padded
  // [B*N] layout that are not padding; packed_rows() int64 [S], the kept tokens' rows of [B*T]
  // in the same order (b-major, ascending positions). Undefined unless ragged.
  const torch::Tensor& live_rows() const { return live_S_; }
  const torch::Tensor& padding_rows() const { return pad_rows_; }  // int64 [B*N - S]: the other rows
  const torch::Tensor& packed_rows() const { return packed_S_; }
  // Ragged masks, one sequence row at a time (row_attention.h): row b's own index (its kept
  // positions, no padding), nullptr when the row keeps nothing; live_slots(b) int64 [N_b], the
  // slots of row b in the padded [N] layout that are not padding.
  TokenIndex* row(int64_t b);
  const torch::Tensor& live_slots(int64_t b) const;
  // x: [B*T, P] token rows (a GEMM's token operand) -> [S, P], the kept tokens' rows packed.
  torch::Tensor cut_packed(const torch::Tensor& x_TP) const;
  // x already cut ([.., N, ..] on spec's token dimensions): padding positions zeroed along every
  // token dimension (keys_only: only the key-role ones). x itself when nothing is padded.
  torch::Tensor zero_padding(const torch::Tensor& x, const ShapeSpec& spec, bool keys_only) const;
  // The same, written into x when x is a fresh cut (shares no memory with `source`, the tensor it
  // was cut from; otherwise as zero_padding). Saves a [B, H, N, N] allocation and its page faults
  // per attention layer: out of place, kept_only's cut probabilities cost tinyllama-mini T = 1024
  // 250 ms more rewrite (B = 4) than in place.
  torch::Tensor zero_padding_into(torch::Tensor x, const torch::Tensor& source, const ShapeSpec& spec,
                                  bool keys_only) const;
  // The same, written into x, which the caller owns (a gradient nobody else holds).
  torch::Tensor zero_padding_in_place(torch::Tensor x, const ShapeSpec& spec) const;

  // Cuts every token dimension of `x` that `spec` marks (key-role dimensions only when
  // cut_keys). x has the sizes the plan expects (checked by the caller).
  torch::Tensor cut(const torch::Tensor& x, const ShapeSpec& spec, bool cut_keys);
  // The inverse of cut: a tensor of `full_sizes` holding x at the cut positions and zeros at every
  // other (a leaf's gradient, accumulated full-size). Any layout cut() takes.
  torch::Tensor uncut(const torch::Tensor& x, const ShapeSpec& spec, bool cut_keys, c10::IntArrayRef full_sizes);
  // Zeroes the dropped positions along every marked token dimension (the `masked` method).
  torch::Tensor zero_dropped(const torch::Tensor& x, const ShapeSpec& spec, bool keys_too);
  // The sizes a cut gives: T -> N, B*T -> B*N; broadcast fields are padded and batch-expanded.
  std::vector<int64_t> cut_sizes(c10::IntArrayRef sizes, const ShapeSpec& spec, bool cut_keys) const;
  // Empty when `sizes` fit `spec` for this B and T; else what differs.
  std::string mismatch(c10::IntArrayRef sizes, const ShapeSpec& spec) const;

  // Mixture-of-experts routes (routes.h). Route `id` sends the token rows positions_R (int64 [R],
  // rows of [B*T]) to one expert; its kept rows are those of kept tokens (kept_K, rows of the
  // route), which sit at cut_positions_K in the cut [B*N] rows. cut() keeps a routed dimension's
  // kept_K rows and turns the route's index into cut_positions_K. Throws collider::Error where an
  // entry is not a row of [B*T].
  // Grouped experts (routes.h) send one route per layer: the [B*T*k] token-expert pairs sorted by
  // expert; their sort's inverse (inverse_S, int64 [B*T*k]: the route row of token slot t*k + j)
  // gives the route's positions. Its cut also remaps offsets (kRoutedOffsets: cumulative rows per
  // expert, counted again over kept rows) and the inverse itself (kTokenSlots: the cut token rows'
  // slots, each to its route row's place among the kept rows).
  struct Route {
    int64_t rows = 0;
    torch::Tensor positions_R, kept_K, cut_positions_K;
    torch::Tensor kept_before_R1;  // grouped: int64 [R+1], kept rows before each row (and in all)
  };
  void add_route(int32_t id, const torch::Tensor& positions_R);
  void add_sorted_route(int32_t id, const torch::Tensor& inverse_S, int64_t slots);
  // Whether x, a field whose values the plan marks as its route's positions (or token slots), is
  // that index.
  bool is_route_index(const torch::Tensor& x, const ShapeSpec& spec) const;
  // A field of a hooked route (below) that keeps its rows but whose values are rows of the token
  // rows (a gather's index) or of their slots: those rows of the cut [B*N] token rows, a dropped
  // token's row 0, where its zero gradient adds nothing.
  torch::Tensor hooked_route_values(const torch::Tensor& x, const ShapeSpec& spec) const;
  // A route behind saved-tensor hooks (routes.h), whose index exists only when the backward unpacks
  // it: not cut, it runs on all its rows. cut_rows_of maps such an index (rows of [B*T]) to rows of
  // the cut [B*N] token rows, -1 where the token was dropped.
  void add_hooked_route(int32_t id, torch::Device device);
  bool hooked_route(int32_t id) const { return hooked_routes_.count(id) > 0; }
  torch::Tensor cut_rows_of(const torch::Tensor& positions_R) const;

 private:
  torch::Tensor zero_padding_impl(torch::Tensor x, bool in_place, const ShapeSpec& spec, bool keys_only) const;
  const Route& route(int32_t id) const;
  torch::Tensor cut_route(const torch::Tensor& x, const ShapeSpec& spec) const;
  torch::Tensor cut_rows_of_slots(const torch::Tensor& slots, int64_t mult) const;
  void build_cut_rows(torch::Device device);  // cut_row_M_ and keep_M_, once
  torch::Tensor cut_dim(const torch::Tensor& x, int64_t batch_dim, int64_t token_dim);
  torch::Tensor cut_in_memory_order(const torch::Tensor& x, const ShapeSpec& spec, bool cut_keys);
  const torch::Tensor& flat_rows(int64_t rows_per_batch);   // [B*rpb*N] row indices into [B*rpb*T]
  const torch::Tensor& flat_rows_seq_first(int64_t mult);   // [N*B*mult] row indices into [T*B*mult]
  const torch::Tensor& flat_rows_per_token(int64_t mult);   // [B*N*mult] row indices into [B*T*mult]
  const torch::Tensor& idx_rows(int64_t rows_per_batch);    // [B*rpb, N] column indices
  const torch::Tensor& idx_square(int64_t rows_per_batch);  // [B*rpb, N*N] flat (i*T + j) indices
  // Both of the last two dims are token dims of one batch row (attention's [.., Tq, Tk]): one pass.
  torch::Tensor cut_last_two(const torch::Tensor& x, int64_t batch_dim);
  // For the AVX-512 cut, per batch row b and 16-column chunk c of its keep mask: the kept
  // columns' lanes (perm [B, C, 16]), their count ([B, C]), and how many leading chunks can be
  // stored as whole 16-lane vectors without passing a kept row's end (full_stores [B]).
  struct ChunkTables {
    std::vector<int32_t> perm, count;
    std::vector<int64_t> full_stores;
  };
  const ChunkTables& chunk_tables();

  int64_t B_, T_, N_;
  torch::Tensor keep_BT_;
  torch::Tensor sel_BT_;             // the cut positions: keep_BT_, plus the padding of ragged rows
  torch::Tensor idx_BN_;             // int64 [B, N], ascending per row
  torch::Tensor pad_BN_;             // bool [B, N], ragged only
  torch::Tensor live_S_, packed_S_;  // int64 [S], ragged only (live_rows, packed_rows)
  torch::Tensor pad_rows_;           // int64 [B*N - S], ragged only (padding_rows)
  std::vector<int64_t> counts_;      // kept per row
  bool ragged_ = false;
  std::map<int64_t, torch::Tensor> flat_cache_, seq_first_cache_, per_token_cache_, rows_cache_, square_cache_;
  ChunkTables chunks_;
  std::vector<std::unique_ptr<TokenIndex>> rows_;  // row(b), built on first use
  std::vector<torch::Tensor> live_slots_;          // [B] x int64 [N_b], ragged only
  std::map<int32_t, Route> routes_;                // add_route
  std::set<int32_t> hooked_routes_;                // add_hooked_route
  torch::Tensor cut_row_M_, keep_M_;               // add_route: [B*T] row -> cut row (-1: cut away); the mask flat
  torch::Tensor rows_BN_;                          // add_route: int64 [B*N], the [B*T] row of each cut row
};

}  // namespace collider::detail
