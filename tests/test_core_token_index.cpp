// TokenIndex, the rewriter's copy kernels (collider_core/src/token_index.cpp), against a plain
// reference built with masked_select-style indexing: row gathers of every row width (whole
// 64-byte lines take the streaming-store path, others memcpy), unaligned sources, permuted
// views cut in memory order (and keeping their layout), attention's [.., T, T] cut for T not a
// multiple of 16, batch rows keeping different tokens, and the mask checks. The model-level
// gradient suites cover the same kernels end to end; this pins them one by one.
//   build/tests/test_core_token_index   (also run with COLLIDER_NO_AVX512=1 in CTest)
#include "../collider_core/src/token_index.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace {

using collider::detail::DimKind;
using collider::detail::DimSpec;
using collider::detail::Role;
using collider::detail::ShapeSpec;
using collider::detail::TokenIndex;

// keep_BT: a mask keeping n tokens per row, different tokens in every row.
torch::Tensor keep_mask(int64_t B, int64_t T, int64_t n, int64_t seed) {
  torch::manual_seed(seed);
  auto keep = torch::zeros({B, T}, torch::kBool);
  for (int64_t b = 0; b < B; ++b) keep[b].index_fill_(0, torch::randperm(T).narrow(0, 0, n), true);
  return keep;
}

// Reference: x indexed along `dim` by the kept positions of each batch row (batch at dim 0).
torch::Tensor reference_cut(const torch::Tensor& x, const torch::Tensor& keep_BT, int64_t dim) {
  std::vector<torch::Tensor> rows;
  for (int64_t b = 0; b < keep_BT.size(0); ++b) {
    auto idx = keep_BT[b].nonzero().squeeze(1);
    rows.push_back(x[b].index_select(dim - 1, idx));
  }
  return torch::stack(rows);
}

ShapeSpec spec(int32_t rank, std::vector<DimSpec> dims) {
  ShapeSpec s;
  s.rank = rank;
  s.dims = std::move(dims);
  return s;
}
DimSpec batch_at(int32_t d) { return {d, DimKind::kBatch, Role::kQuery, 1}; }
DimSpec token_at(int32_t d, Role r = Role::kQuery) { return {d, DimKind::kToken, r, 1}; }

TEST(TokenIndexCut, RowGatherMatchesReferenceForEveryRowWidth) {
  const int64_t B = 3, T = 37, N = 20;
  auto keep = keep_mask(B, T, N, 1);
  TokenIndex ix(keep);
  for (int64_t D : {1, 3, 16, 17, 64, 100, 256}) {
    auto x_BTD = torch::randn({B, T, D});
    auto out = ix.cut(x_BTD, spec(3, {batch_at(0), token_at(1)}), true);
    EXPECT_TRUE(torch::equal(out, reference_cut(x_BTD, keep, 1))) << "D = " << D;
  }
}

// Sequence-first tensors (torch::nn's [T, B, D]) and their flattened [T*B, D] rows (row t*B + b).
TEST(TokenIndexCut, SequenceFirstTensorsAndRows) {
  const int64_t B = 3, T = 29, N = 13, D = 8;
  auto keep = keep_mask(B, T, N, 5);
  TokenIndex ix(keep);
  auto x_TBD = torch::randn({T, B, D});
  auto want_NBD = reference_cut(x_TBD.transpose(0, 1), keep, 1).transpose(0, 1);  // [N, B, D]
  auto out = ix.cut(x_TBD, spec(3, {token_at(0), batch_at(1)}), true);
  EXPECT_TRUE(torch::equal(out, want_NBD));
  EXPECT_EQ(ix.cut_sizes(x_TBD.sizes(), spec(3, {token_at(0), batch_at(1)}), true), (std::vector<int64_t>{N, B, D}));
  auto flat = spec(2, {DimSpec{0, DimKind::kFlatSeqFirst, Role::kQuery, 1}});
  auto out_flat = ix.cut(x_TBD.reshape({T * B, D}), flat, true);
  EXPECT_TRUE(torch::equal(out_flat, want_NBD.reshape({N * B, D})));
  // A batch dimension of B*H rows (row b*H + h) after the token dimension: [T, B*H, E].
  const int64_t H = 2;
  auto y = torch::randn({T, B * H, D});
  DimSpec bh{1, DimKind::kBatch, Role::kQuery, H};
  auto want = reference_cut(y.view({T, B, H * D}).transpose(0, 1), keep, 1).transpose(0, 1).reshape({N, B * H, D});
  EXPECT_TRUE(torch::equal(ix.cut(y, spec(3, {token_at(0), bh}), true), want));
  // A non-contiguous [T, B, D] (the transpose of a [B, T, D]) is cut in memory order.
  auto z_BTD = torch::randn({B, T, D});
  auto z_TBD = z_BTD.transpose(0, 1);
  EXPECT_TRUE(torch::equal(ix.cut(z_TBD, spec(3, {token_at(0), batch_at(1)}), true),
                           reference_cut(z_BTD, keep, 1).transpose(0, 1)));
  // Zeroing (the masked method) along the same layouts.
  auto keep_TB1 = keep.t().unsqueeze(2).to(torch::kFloat);
  EXPECT_TRUE(torch::equal(ix.zero_dropped(x_TBD, spec(3, {token_at(0), batch_at(1)}), true), x_TBD * keep_TB1));
  EXPECT_TRUE(
      torch::equal(ix.zero_dropped(x_TBD.reshape({T * B, D}), flat, true), (x_TBD * keep_TB1).reshape({T * B, D})));
}

TEST(TokenIndexCut, UnalignedSourceRows) {
  const int64_t B = 2, T = 40, N = 24, D = 64;
  auto keep = keep_mask(B, T, N, 2);
  TokenIndex ix(keep);
  // A view starting 4 bytes into its storage: rows are whole lines but not line-aligned.
  auto base = torch::randn({B * T * D + 1});
  auto x_BTD = base.narrow(0, 1, B * T * D).view({B, T, D});
  auto out = ix.cut(x_BTD, spec(3, {batch_at(0), token_at(1)}), true);
  EXPECT_TRUE(torch::equal(out, reference_cut(x_BTD.contiguous(), keep, 1)));
}

TEST(TokenIndexCut, FlatTokenRows) {
  const int64_t B = 2, T = 33, N = 17, D = 48;
  auto keep = keep_mask(B, T, N, 3);
  TokenIndex ix(keep);
  auto x_MD = torch::randn({B * T, D});  // [B*T, D], as linear layers save their input
  auto out = ix.cut(x_MD, spec(2, {{0, DimKind::kFlatToken, Role::kQuery, 1}}), true);
  auto want = reference_cut(x_MD.view({B, T, D}), keep, 1).reshape({B * N, D});
  EXPECT_TRUE(torch::equal(out, want));
}

// [B, T, H, D] flattened to [B*T*H, D] (a per-head norm): H rows per position, row (b*T + t)*H + h.
TEST(TokenIndexCut, FlatRowsPerToken) {
  for (int64_t B : {3, 1}) {
  const int64_t T = 31, N = 12, H = 4, D = 8;
  auto keep = keep_mask(B, T, N, 6);
  TokenIndex ix(keep);
  auto x_BTHD = torch::randn({B, T, H, D});
  auto per_token = spec(2, {{0, DimKind::kFlatPerToken, Role::kQuery, H}});
  auto want = reference_cut(x_BTHD, keep, 1).reshape({B * N * H, D});
  EXPECT_TRUE(torch::equal(ix.cut(x_BTHD.reshape({B * T * H, D}), per_token, true), want));
  EXPECT_EQ(ix.cut_sizes({B * T * H, D}, per_token, true), (std::vector<int64_t>{B * N * H, D}));
  auto keep_BT11 = keep.view({B, T, 1, 1}).to(torch::kFloat);
  EXPECT_TRUE(torch::equal(ix.zero_dropped(x_BTHD.reshape({B * T * H, D}), per_token, true),
                           (x_BTHD * keep_BT11).reshape({B * T * H, D})));
  auto back = ix.uncut(want, per_token, true, {B * T * H, D});
  EXPECT_TRUE(torch::equal(back, (x_BTHD * keep_BT11).reshape({B * T * H, D})));
  }
}

TEST(TokenIndexCut, PermutedViewIsCutInMemoryOrderAndKeepsItsLayout) {
  const int64_t B = 3, T = 29, H = 4, E = 16, N = 13;
  auto keep = keep_mask(B, T, N, 4);
  TokenIndex ix(keep);
  // Attention's q as [B, H, T, E], a transposed view of [B, T, H, E] memory.
  auto q_BHTE = torch::randn({B, T, H, E}).transpose(1, 2);
  ASSERT_FALSE(q_BHTE.is_contiguous());
  auto out = ix.cut(q_BHTE, spec(4, {batch_at(0), token_at(2)}), true);
  EXPECT_TRUE(torch::equal(out, reference_cut(q_BHTE, keep, 2)));
  EXPECT_TRUE(out.is_non_overlapping_and_dense());
  EXPECT_GT(out.stride(2), out.stride(1)) << "the cut should keep the [B, T, H, E] memory order";
  EXPECT_EQ(out.stride(1), E);
}

TEST(TokenIndexCut, AttentionSquareCutForTNotAMultipleOf16) {
  for (int64_t T : {16, 23, 97}) {
    const int64_t B = 2, H = 3, N = T / 2 + 1;
    auto keep = keep_mask(B, T, N, T);
    TokenIndex ix(keep);
    auto p_BHTT = torch::randn({B, H, T, T});
    auto out = ix.cut(p_BHTT, spec(4, {batch_at(0), token_at(2), token_at(3, Role::kKey)}), true);
    auto want = reference_cut(reference_cut(p_BHTT, keep, 2), keep, 3);
    EXPECT_TRUE(torch::equal(out, want)) << "T = " << T;
    // exact_query keeps the key columns: rows only.
    auto rows = ix.cut(p_BHTT, spec(4, {batch_at(0), token_at(2), token_at(3, Role::kKey)}), false);
    EXPECT_TRUE(torch::equal(rows, reference_cut(p_BHTT, keep, 2))) << "T = " << T;
  }
}

TEST(TokenIndexCut, ThreadCountDoesNotChangeTheResult) {
  const int64_t B = 2, T = 512, N = 304, H = 2;
  auto keep = keep_mask(B, T, N, 5);
  TokenIndex ix(keep);
  auto p_BHTT = torch::randn({B, H, T, T});
  const auto s = spec(4, {batch_at(0), token_at(2), token_at(3, Role::kKey)});
  const int threads = torch::get_num_threads();
  torch::set_num_threads(1);
  auto one = ix.cut(p_BHTT, s, true);
  torch::set_num_threads(std::max(2, threads));
  auto many = ix.cut(p_BHTT, s, true);
  torch::set_num_threads(threads);
  EXPECT_TRUE(torch::equal(one, many));
}

TEST(TokenIndexMask, BuildsKeptPositionsPadsRaggedRowsAndRefusesBadMasks) {
  auto keep = keep_mask(3, 29, 11, 6);
  TokenIndex ix(keep);
  ASSERT_EQ(ix.N(), 11);
  // The positions are ascending per row (the cuts rely on it) and match the mask.
  auto positions = ix.cut(torch::arange(29).expand({3, 29}).contiguous(), spec(2, {batch_at(0), token_at(1)}), true);
  for (int64_t b = 0; b < 3; ++b) EXPECT_TRUE(torch::equal(positions[b], keep[b].nonzero().squeeze(1)));
  EXPECT_FALSE(ix.ragged());
  // Ragged counts: rows are cut to the largest count, padded with their first dropped positions,
  // still ascending; the padding is marked.
  auto ragged = keep.clone();
  ragged[1][ragged[1].nonzero()[0][0]] = false;  // row 1 keeps 10
  ragged[2].fill_(false);                        // row 2 keeps none
  TokenIndex rx(ragged);
  ASSERT_TRUE(rx.ragged());
  EXPECT_EQ(rx.N(), 11);
  EXPECT_EQ(rx.kept_counts(), (std::vector<int64_t>{11, 10, 0}));
  EXPECT_EQ(rx.kept_total(), 21);
  for (int64_t b = 0; b < 3; ++b) {
    auto pos = rx.idx_BN()[b];
    EXPECT_TRUE(torch::equal(std::get<0>(pos.sort()), pos)) << "row " << b << " not ascending";
    // the kept positions, each unpadded; the padding, dropped positions
    auto kept_at = ragged[b].index_select(0, pos);
    EXPECT_TRUE(torch::equal(kept_at, ~rx.pad_BN()[b])) << "row " << b;
    EXPECT_EQ(kept_at.sum().item<int64_t>(), rx.kept_counts()[b]);
  }
  auto x_BND = torch::ones({3, 11, 4});
  auto zeroed = rx.zero_padding(x_BND, spec(3, {batch_at(0), token_at(1)}), false);
  EXPECT_EQ(zeroed.sum().item<double>(), 21 * 4);
  EXPECT_THROW(TokenIndex{torch::zeros({2, 8}, torch::kBool)}, collider::Error);
  EXPECT_THROW(TokenIndex{torch::zeros({0, 8}, torch::kBool)}, collider::Error);
  EXPECT_THROW(TokenIndex{torch::ones({2, 8})}, collider::Error);  // not bool
}

}  // namespace
