// Internal: fused gather of the kept rows of several saved tensors in ONE kernel launch (the GPU plan's
// "fused gather: one kernel per layer for all its saved tensors"), and the plain-ATen version with
// the same contract (index_select per tensor) for tests and comparisons. Built only with
// COLLIDER_CUDA=ON, into collider_cuda_gather (not collider_core: the rewriter does not call it yet,
// that waits for a GPU measurement of gather_ms), which defines COLLIDER_WITH_CUDA for its users.
// Legend: R_src source rows, R_dst kept rows (= index length).
// Tested by tests/gpu/test_gpu_gather.cpp.
#pragma once

#include <cuda_runtime_api.h>
#include <torch/torch.h>

#include <vector>

namespace collider::detail {

// One tensor to gather. Rows are along dim 0: src [R_src, ...] and dst [R_dst, ...] are contiguous,
// of one dtype and device, with equal trailing sizes' product (so rows of equal bytes); a view such
// as x_BHTE.view({B * H * T, E}) turns any row layout into this one. dst[r] = src[src_row[r]].
struct GatherJob {
  torch::Tensor src;      // [R_src, ...] contiguous
  torch::Tensor dst;      // [R_dst, ...] contiguous, written; must not overlap src
  torch::Tensor src_row;  // int64 [R_dst] on src's device, values in [0, R_src); undefined: row_index
};

// Copies every job's rows with one kernel launch per 32 non-empty jobs, on `stream` (no host
// synchronisation, no allocation). `row_index` (int64 [R_dst] on the device) is the index of the
// jobs whose src_row is undefined; it may be undefined when every job has its own. Tensors must be
// CUDA tensors on one device; throws c10::Error naming the job and what is wrong otherwise. An index
// value outside [0, R_src) stops the kernel with a device assert.
void gather_rows_fused(const std::vector<GatherJob>& jobs, const torch::Tensor& row_index, cudaStream_t stream);

// The same contract with one index_select per job (ATen kernels, on `stream` for CUDA tensors; CPU
// tensors too, stream ignored): the reference the fused kernel is tested against.
void gather_rows_aten(const std::vector<GatherJob>& jobs, const torch::Tensor& row_index, cudaStream_t stream);

}  // namespace collider::detail
