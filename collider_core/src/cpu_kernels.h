// Internal: the CPU copy kernels of the token cut (token_index.cpp calls them). Raw loops over
// contiguous memory split over torch's intra-op threads; cpu_kernels.cpp is the one file of the
// library compiled with OpenMP. Legend: R rows, T sequence, N kept per sequence, B batch,
// C 16-column chunks of a row (C = ceil(T / 16)), M source rows, P row length.
#pragma once

#include <torch/torch.h>

#include <cstddef>
#include <cstdint>

namespace collider::detail {

// out_RNN[r, i, j] = x_RTT[r, idx_BN[r / rpb, i], idx_BN[r / rpb, j]] for contiguous x [R, T, T]
// and out [R, N, N] of `element_size`-byte elements. False (nothing written) for an element size
// with no kernel (1, 2, 4 and 8 have one).
bool square_cut_portable(const void* x, void* out, size_t element_size, const int64_t* idx_BN, int64_t R, int64_t rpb,
                         int64_t T, int64_t N);

#if defined(__x86_64__) && defined(__GNUC__)
// The same cut for 4-byte elements with AVX-512, from the per-sequence chunk tables of the keep
// mask (TokenIndex::ChunkTables: perm_BC16, count_BC, full_B); call only when have_avx512().
void square_cut_avx512(const float* x, float* out, const int64_t* idx_BN, const int32_t* perm_BC16,
                       const int32_t* count_BC, const int64_t* full_B, int64_t R, int64_t rpb, int64_t T, int64_t N);
// The CPU has AVX-512F and COLLIDER_NO_AVX512 is unset.
bool have_avx512();
#endif

// out_NP[i] = x_MP[idx_N[i]]: the row copy kernels for contiguous CPU tensors, index_select for
// anything else. stream: write around the cache (for copies read much later, like the cut saved
// tensors); false for a gradient the backward reads next: a packed gradient written with streaming
// stores slowed the GEMM right after it by ~30% (qwen2.5-mini MLP shapes, 2 CPU cores).
torch::Tensor gather_rows(const torch::Tensor& x_MP, const torch::Tensor& idx_N, bool stream = true);
// Its inverse into M rows: out_MP[idx_N[i]] = x_NP[i] and out_MP[zero_Z[j]] = 0, where idx and
// zero together name every row once (ragged masks: packed rows back to the padded layout). One
// memcpy or memset per row for contiguous CPU tensors, index_copy_ / index_fill_ elsewhere.
torch::Tensor scatter_rows(const torch::Tensor& x_NP, const torch::Tensor& idx_N, const torch::Tensor& zero_Z,
                           int64_t M);

}  // namespace collider::detail
