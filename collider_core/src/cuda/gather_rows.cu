// Fused multi-tensor row gather ("one kernel per layer for all its saved tensors"). One
// launch copies the kept rows of up to kMaxJobsPerLaunch tensors; each block belongs to one job and
// copies kGatherThreads * kGatherVectorsPerThread vectors of it (16-byte vectors where the base
// pointers and the row size allow, else 8/4/2/1), consecutive threads on consecutive bytes of a row.
// No torch headers here (nvcc compiles this file in seconds); the checked torch API is
// gather_rows.h / gather_rows.cpp. Compiled only with COLLIDER_CUDA=ON (sm_90).
// Test: build/tests/test_gpu_gather (compares with index_select; skips without a device).
#include "gather_rows_kernel.h"

#include <cassert>
#include <climits>
#include <cstdint>

// Out-of-range source rows stop the kernel with a device assert (as ATen's index kernels do),
// also in release builds: a silent out-of-bounds read would corrupt the backward.
#define COLLIDER_DEVICE_CHECK(cond)                                                         \
  do {                                                                                      \
    if (!(cond)) __assert_fail(#cond, __FILE__, static_cast<unsigned>(__LINE__), __func__); \
  } while (0)

namespace collider::detail::cuda {
namespace {

constexpr int64_t kVectorsPerBlock = static_cast<int64_t>(kGatherThreads) * kGatherVectorsPerThread;

// One job as the kernel sees it; counts in vectors of vector_bytes.
struct LaunchJob {
  const char* src;
  char* dst;
  const int64_t* src_row_N;
  int64_t num_src_rows;
  int64_t row_vectors;  // vectors per row
  int64_t num_vectors;  // num_rows * row_vectors
  int64_t first_block;  // the job's first block in the launch's grid
  int32_t vector_bytes;
};

struct LaunchParams {
  LaunchJob jobs[kMaxJobsPerLaunch];
  int32_t num_jobs;
};
static_assert(sizeof(LaunchParams) <= 4000, "kernel parameters are limited to 4 KB");

template <typename V>
__device__ __forceinline__ void copy_vectors(const LaunchJob& job, int64_t first_vector) {
  const V* __restrict__ src = reinterpret_cast<const V*>(job.src);
  V* __restrict__ dst = reinterpret_cast<V*>(job.dst);
  V vals[kGatherVectorsPerThread];
  int64_t out[kGatherVectorsPerThread];
  // All loads first, then all stores: kGatherVectorsPerThread loads in flight per thread.
#pragma unroll
  for (int i = 0; i < kGatherVectorsPerThread; ++i) {
    const int64_t v = first_vector + static_cast<int64_t>(i) * kGatherThreads + threadIdx.x;
    out[i] = -1;
    if (v < job.num_vectors) {
      const int64_t r = v / job.row_vectors;
      const int64_t c = v - r * job.row_vectors;
      const int64_t s = job.src_row_N[r];
      COLLIDER_DEVICE_CHECK(s >= 0 && s < job.num_src_rows);
      vals[i] = src[s * job.row_vectors + c];
      out[i] = v;
    }
  }
#pragma unroll
  for (int i = 0; i < kGatherVectorsPerThread; ++i) {
    if (out[i] >= 0) dst[out[i]] = vals[i];
  }
}

// __grid_constant__: the job table is read in place from parameter memory (no local copy when
// indexed with the block's job number).
__global__ void __launch_bounds__(kGatherThreads) gather_rows_kernel(const __grid_constant__ LaunchParams p) {
  const int64_t block = blockIdx.x;
  int j = 0;
  while (j + 1 < p.num_jobs && block >= p.jobs[j + 1].first_block) ++j;  // at most 31 steps, block-uniform
  const LaunchJob& job = p.jobs[j];
  const int64_t first_vector = (block - job.first_block) * kVectorsPerBlock;
  switch (job.vector_bytes) {
    case 16:
      copy_vectors<uint4>(job, first_vector);
      break;
    case 8:
      copy_vectors<uint2>(job, first_vector);
      break;
    case 4:
      copy_vectors<uint32_t>(job, first_vector);
      break;
    case 2:
      copy_vectors<uint16_t>(job, first_vector);
      break;
    default:
      copy_vectors<uint8_t>(job, first_vector);
      break;
  }
}

}  // namespace

int choose_vector_bytes(const void* src, const void* dst, int64_t row_bytes) {
  const uintptr_t bits =
      reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) | static_cast<uintptr_t>(row_bytes);
  for (int w = 16; w > 1; w /= 2) {
    if (bits % static_cast<uintptr_t>(w) == 0) return w;
  }
  return 1;
}

int64_t count_gather_blocks(const RowCopyJob& job) {
  if (job.num_rows <= 0 || job.row_bytes <= 0) return 0;
  const int64_t vectors = job.num_rows * (job.row_bytes / choose_vector_bytes(job.src, job.dst, job.row_bytes));
  return (vectors + kVectorsPerBlock - 1) / kVectorsPerBlock;
}

int count_gather_launches(const RowCopyJob* jobs, int num_jobs) {
  int launches = 0, in_launch = 0;
  int64_t blocks = 0;
  for (int i = 0; i < num_jobs; ++i) {
    const int64_t nb = count_gather_blocks(jobs[i]);
    if (nb == 0) continue;
    if (in_launch == 0 || in_launch == kMaxJobsPerLaunch || blocks + nb > INT_MAX) {
      ++launches;
      in_launch = 0;
      blocks = 0;
    }
    ++in_launch;
    blocks += nb;
  }
  return launches;
}

cudaError_t gather_rows_launch(const RowCopyJob* jobs, int num_jobs, cudaStream_t stream) {
  LaunchParams p{};
  int64_t blocks = 0;
  auto flush = [&]() -> cudaError_t {
    if (p.num_jobs == 0) return cudaSuccess;
    gather_rows_kernel<<<static_cast<unsigned>(blocks), kGatherThreads, 0, stream>>>(p);
    p.num_jobs = 0;
    blocks = 0;
    return cudaGetLastError();
  };
  for (int i = 0; i < num_jobs; ++i) {
    const RowCopyJob& in = jobs[i];
    const int64_t nb = count_gather_blocks(in);
    if (nb == 0) continue;
    if (nb > INT_MAX) return cudaErrorInvalidValue;  // > 2^31 blocks: a tensor of terabytes
    // Same splitting rule as count_gather_launches.
    if (p.num_jobs == kMaxJobsPerLaunch || blocks + nb > INT_MAX) {
      if (const cudaError_t err = flush(); err != cudaSuccess) return err;
    }
    const int w = choose_vector_bytes(in.src, in.dst, in.row_bytes);
    LaunchJob& out = p.jobs[p.num_jobs++];
    out.src = static_cast<const char*>(in.src);
    out.dst = static_cast<char*>(in.dst);
    out.src_row_N = in.src_row_N;
    out.num_src_rows = in.num_src_rows;
    out.row_vectors = in.row_bytes / w;
    out.num_vectors = in.num_rows * out.row_vectors;
    out.first_block = blocks;
    out.vector_bytes = w;
    blocks += nb;
  }
  return flush();
}

}  // namespace collider::detail::cuda
