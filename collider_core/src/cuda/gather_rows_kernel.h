// Internal, torch-free: the launcher of the fused row-gather kernel (gather_rows.cu). Kept free of
// torch headers so that nvcc compiles gather_rows.cu in seconds; the torch-facing API with its
// argument checks is gather_rows.h. One launch copies the kept rows of up to kMaxJobsPerLaunch
// tensors: dst row r of job j = src row idx[r] of job j, `row_bytes` bytes each, with the widest
// vector (16, 8, 4, 2 or 1 bytes) that the two base pointers and the row size allow.
// Tested by tests/gpu/test_gpu_gather.cpp (the planning functions also without a device).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace collider::detail::cuda {

// Jobs carried by one launch (by value in the kernel's parameters, 64 bytes each, < 4 KB).
constexpr int kMaxJobsPerLaunch = 32;
// Threads per block and vectors per thread of the gather kernel.
constexpr int kGatherThreads = 256;
constexpr int kGatherVectorsPerThread = 4;

// One tensor to gather: contiguous src [num_src_rows, row_bytes] -> contiguous dst
// [num_rows, row_bytes] with dst[r] = src[src_row_N[r]]. src_row_N: int64 [num_rows] on the device,
// values in [0, num_src_rows) (checked in the kernel: an out-of-range row is a device assert).
struct RowCopyJob {
  const void* src = nullptr;
  void* dst = nullptr;
  const int64_t* src_row_N = nullptr;
  int64_t num_src_rows = 0;
  int64_t num_rows = 0;
  int64_t row_bytes = 0;
};

// The widest copy unit (16, 8, 4, 2 or 1 bytes) dividing both addresses and row_bytes.
int choose_vector_bytes(const void* src, const void* dst, int64_t row_bytes);

// Blocks of kGatherThreads * kGatherVectorsPerThread vectors one job needs (0 for an empty job).
int64_t count_gather_blocks(const RowCopyJob& job);

// Number of kernel launches gather_rows_launch makes for these jobs (empty jobs take none).
int count_gather_launches(const RowCopyJob* jobs, int num_jobs);

// Enqueues the copies on `stream` (kernel launches only: no allocation, no synchronisation).
// Returns the launch error (cudaSuccess when every launch was accepted).
cudaError_t gather_rows_launch(const RowCopyJob* jobs, int num_jobs, cudaStream_t stream);

}  // namespace collider::detail::cuda
