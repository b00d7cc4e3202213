// The CPU copy kernels of the token cut (see cpu_kernels.h): attention's [.., T, T] square cut
// (portable, and AVX-512 with per-sequence permutation tables) and row gathers (memcpy, and
// AVX-512 streaming stores). They run on torch's intra-op threads through at::parallel_for, which
// is why this file alone is compiled with OpenMP (collider_core/CMakeLists.txt). On this
// project's 2-core machine they run at its copy bandwidth (results/bm_collider_backward/README.md,
// the side-by-side backward benchmark). Tested by tests/test_core_token_index.cpp (also with
// COLLIDER_NO_AVX512=1).
#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace collider::detail {

namespace {

// CPU: out[r, i, j] = x[r, idx[r / rpb, i], idx[r / rpb, j]] for contiguous x [R, T, T] and
// out [R, N, N]; the element type only matters through its size. Reads N indices per row
// (the generic gather reads an int64 index per element, as much memory as the data).
template <typename E>
void square_cut_cpu(const E* x, E* out, const int64_t* idx_BN, int64_t R, int64_t rpb, int64_t T, int64_t N) {
  at::parallel_for(0, R * N, 32, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t r = row / N, i = row % N;
      const int64_t* idx_N = idx_BN + (r / rpb) * N;
      const E* src_T = x + (r * T + idx_N[i]) * T;
      E* dst_N = out + row * N;
      for (int64_t j = 0; j < N; ++j) dst_N[j] = src_T[idx_N[j]];
    }
  });
}

}  // namespace

bool square_cut_portable(const void* x, void* out, size_t element_size, const int64_t* idx_BN, int64_t R, int64_t rpb,
                         int64_t T, int64_t N) {
  auto run = [&](auto elem) {
    using E = decltype(elem);
    square_cut_cpu(static_cast<const E*>(x), static_cast<E*>(out), idx_BN, R, rpb, T, N);
  };
  switch (element_size) {
    case 1:
      run(uint8_t{});
      return true;
    case 2:
      run(uint16_t{});
      return true;
    case 4:
      run(uint32_t{});
      return true;
    case 8:
      run(uint64_t{});
      return true;
    default:
      return false;
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
namespace {

// The same cut for 4-byte elements with AVX-512: every kept row of batch row b drops the same
// columns, so each 16-column chunk is packed by one permutation precomputed from b's keep mask
// (perm_BC16) and stored whole; the store advances by the chunk's kept count, the next store
// overwrites the unused lanes. Only the chunks whose whole store could pass the row's end use
// masked stores (full_B: how many do not). ~1.3x faster than per-chunk compress with masked
// stores (0.20 vs 0.27 ms for [8, 512, 512] -> [8, 304, 304] on 2 cores). Loads of the last
// chunk are masked, so nothing outside a row is read either.
__attribute__((target("avx512f"))) void pack_rows_avx512(const float* x, float* out, const int64_t* idx_BN,
                                                         const int32_t* perm_BC16, const int32_t* count_BC,
                                                         const int64_t* full_B, int64_t begin, int64_t end, int64_t rpb,
                                                         int64_t T, int64_t N) {
  const int64_t C = (T + 15) / 16;
  const __mmask16 tail = static_cast<__mmask16>(T % 16 == 0 ? 0xFFFF : (1u << (T % 16)) - 1);
  for (int64_t row = begin; row < end; ++row) {
    const int64_t r = row / N, i = row % N, b = r / rpb;
    const float* src_T = x + (r * T + idx_BN[b * N + i]) * T;
    const int32_t* perm_C16 = perm_BC16 + b * C * 16;
    const int32_t* count_C = count_BC + b * C;
    float* dst = out + row * N;
    const int64_t full = full_B[b];
    for (int64_t c = 0; c < C; ++c) {
      const __m512 v = _mm512_maskz_loadu_ps(c + 1 == C ? tail : 0xFFFF, src_T + 16 * c);
      // (maskz with all lanes: the plain intrinsic makes GCC 12 warn about an undefined source)
      const __m512 packed = _mm512_maskz_permutexvar_ps(0xFFFF, _mm512_loadu_si512(perm_C16 + 16 * c), v);
      const int n = count_C[c];
      if (c < full) {
        _mm512_storeu_ps(dst, packed);
      } else {
        _mm512_mask_storeu_ps(dst, static_cast<__mmask16>((1u << n) - 1), packed);
      }
      dst += n;
    }
  }
}

}  // namespace

void square_cut_avx512(const float* x, float* out, const int64_t* idx_BN, const int32_t* perm_BC16,
                       const int32_t* count_BC, const int64_t* full_B, int64_t R, int64_t rpb, int64_t T, int64_t N) {
  at::parallel_for(0, R * N, 32, [&](int64_t begin, int64_t end) {
    pack_rows_avx512(x, out, idx_BN, perm_BC16, count_BC, full_B, begin, end, rpb, T, N);
  });
}

namespace {

// Row copies with non-temporal stores: the cut copies go to memory the backward reads much
// later, so writing around the cache saves the read-for-ownership of every destination line
// (~20% on a cold destination: 23 -> 28 GB/s for 6 KB rows on 2 cores). Rows are whole
// 64-byte lines, source and destination 64-byte aligned (checked by the caller).
__attribute__((target("avx512f"))) void stream_rows_avx512(const char* src, char* dst, const int64_t* idx,
                                                           int64_t begin, int64_t end, size_t row_bytes) {
  for (int64_t i = begin; i < end; ++i) {
    const char* s = src + idx[i] * row_bytes;
    char* d = dst + i * row_bytes;
    for (size_t o = 0; o < row_bytes; o += 64) {
      _mm512_stream_si512(reinterpret_cast<__m512i*>(d + o), _mm512_load_si512(reinterpret_cast<const void*>(s + o)));
    }
  }
  _mm_sfence();  // the stores are visible before the task ends
}

}  // namespace

// COLLIDER_NO_AVX512=1 forces the portable loop (tested that way too: tests/CMakeLists.txt).
bool have_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && std::getenv("COLLIDER_NO_AVX512") == nullptr;
  return yes;
}
#endif

// out_NP[i] = x_MP[idx_N[i]] for a contiguous CPU x: one memcpy per row, rows split over the
// intra-op threads. index_select does the same through TensorIterator at ~1.7x the time
// (0.33 vs 0.19 ms for a 5 MB gather on 2 cores); other devices keep index_select.
torch::Tensor gather_rows(const torch::Tensor& x_MP, const torch::Tensor& idx_N, bool stream) {
  if (!x_MP.is_cpu() || !x_MP.is_contiguous() || !idx_N.is_cpu() || !idx_N.is_contiguous() || x_MP.dim() != 2) {
    return x_MP.index_select(0, idx_N);
  }
  const int64_t N = idx_N.numel();
  auto out_NP = torch::empty({N, x_MP.size(1)}, x_MP.options());
  const size_t row_bytes = static_cast<size_t>(x_MP.size(1)) * x_MP.element_size();
  if (N == 0 || row_bytes == 0) return out_NP;
  const char* src = static_cast<const char*>(x_MP.const_data_ptr());
  char* dst = static_cast<char*>(out_NP.data_ptr());
  const int64_t* idx = idx_N.const_data_ptr<int64_t>();
  const int64_t grain = std::max<int64_t>(1, static_cast<int64_t>((size_t(64) << 10) / row_bytes));  // >= 64 KiB a task
#if defined(__x86_64__) && defined(__GNUC__)
  if (stream && have_avx512() && row_bytes % 64 == 0 && reinterpret_cast<uintptr_t>(src) % 64 == 0 &&
      reinterpret_cast<uintptr_t>(dst) % 64 == 0) {
    at::parallel_for(0, N, grain,
                     [&](int64_t begin, int64_t end) { stream_rows_avx512(src, dst, idx, begin, end, row_bytes); });
    return out_NP;
  }
#endif
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) std::memcpy(dst + i * row_bytes, src + idx[i] * row_bytes, row_bytes);
  });
  return out_NP;
}

// index_copy_ ran at ~6 GB/s on 2 cores (TensorIterator per row); rows written here by memcpy,
// with ordinary stores: the backward reads the result next, from the cache where it can.
torch::Tensor scatter_rows(const torch::Tensor& x_NP, const torch::Tensor& idx_N, const torch::Tensor& zero_Z,
                           int64_t M) {
  auto out_MP = torch::empty({M, x_NP.size(1)}, x_NP.options());
  if (!x_NP.is_cpu() || !x_NP.is_contiguous() || !idx_N.is_cpu() || !idx_N.is_contiguous() || !zero_Z.is_cpu() ||
      !zero_Z.is_contiguous() || x_NP.dim() != 2) {
    return out_MP.index_copy_(0, idx_N, x_NP).index_fill_(0, zero_Z, 0);
  }
  const int64_t N = idx_N.numel(), Z = zero_Z.numel();
  const size_t row_bytes = static_cast<size_t>(x_NP.size(1)) * x_NP.element_size();
  if (row_bytes == 0) return out_MP;
  const char* src = static_cast<const char*>(x_NP.const_data_ptr());
  char* dst = static_cast<char*>(out_MP.data_ptr());
  const int64_t *idx = idx_N.const_data_ptr<int64_t>(), *zero = zero_Z.const_data_ptr<int64_t>();
  const int64_t grain = std::max<int64_t>(1, static_cast<int64_t>((size_t(64) << 10) / row_bytes));  // >= 64 KiB a task
  at::parallel_for(0, N + Z, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (i < N)
        std::memcpy(dst + idx[i] * row_bytes, src + i * row_bytes, row_bytes);
      else
        std::memset(dst + zero[i - N] * row_bytes, 0, row_bytes);
    }
  });
  return out_MP;
}

}  // namespace collider::detail
