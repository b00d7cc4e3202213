// The checked torch API of the fused row gather (gather_rows.h): validates the jobs, turns them
// into raw RowCopyJobs and calls the launcher in gather_rows.cu; and the ATen reference with the
// same contract. Compiled only with COLLIDER_CUDA=ON (collider_core/CMakeLists.txt).
// Test: build/tests/test_gpu_gather (checks run without a device; copies need one).
#include "gather_rows.h"

#include "gather_rows_kernel.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/accumulate.h>

#include <optional>
#include <string>

namespace collider::detail {
namespace {

struct CheckedJob {
  torch::Tensor src;    // [R_src, row_elems] view
  torch::Tensor dst;    // [R_dst, row_elems] view
  torch::Tensor index;  // int64 [R_dst]
  int64_t row_bytes;
};

std::string describe(const torch::Tensor& t) {
  return std::string(c10::toString(t.scalar_type())) + " " + c10::str(t.sizes()) + " on " + t.device().str();
}

// Checks the contract of gather_rows.h; `who` names the caller in the messages.
std::vector<CheckedJob> check_jobs(const std::vector<GatherJob>& jobs, const torch::Tensor& row_index, const char* who,
                                   bool need_cuda) {
  std::vector<CheckedJob> out;
  out.reserve(jobs.size());
  if (row_index.defined()) {
    TORCH_CHECK(row_index.scalar_type() == torch::kLong && row_index.dim() == 1 && row_index.is_contiguous(), who,
                ": row_index must be a contiguous int64 vector of kept source rows, got ", describe(row_index));
  }
  for (size_t i = 0; i < jobs.size(); ++i) {
    const GatherJob& job = jobs[i];
    TORCH_CHECK(job.src.defined() && job.dst.defined(), who, ": job ", i, " has an undefined src or dst tensor");
    const torch::Tensor& src = job.src;
    const torch::Tensor& dst = job.dst;
    TORCH_CHECK(src.dim() >= 1 && dst.dim() >= 1, who, ": job ", i, " needs tensors with rows along dim 0, got src ",
                describe(src), " and dst ", describe(dst));
    TORCH_CHECK(src.scalar_type() == dst.scalar_type() && src.device() == dst.device(), who, ": job ", i,
                ": src and dst must have one dtype and device, got src ", describe(src), " and dst ", describe(dst));
    TORCH_CHECK(!need_cuda || src.is_cuda(), who, ": job ", i, ": the fused gather needs CUDA tensors, got ",
                describe(src), "; use gather_rows_aten for CPU tensors");
    TORCH_CHECK(jobs[0].src.device() == src.device(), who, ": job ", i, " is on ", src.device().str(), " but job 0 on ",
                jobs[0].src.device().str(), "; one call gathers on one device");
    TORCH_CHECK(src.is_contiguous() && dst.is_contiguous(), who, ": job ", i,
                ": src and dst must be contiguous (call .contiguous() on the source first), got src strides ",
                c10::str(src.strides()), ", dst strides ", c10::str(dst.strides()));
    TORCH_CHECK(!dst.is_alias_of(src), who, ": job ", i, ": dst shares storage with src; gather into a new tensor");
    const int64_t R_src = src.size(0), R_dst = dst.size(0);
    const int64_t row_elems = c10::multiply_integers(src.sizes().slice(1));
    TORCH_CHECK(c10::multiply_integers(dst.sizes().slice(1)) == row_elems, who, ": job ", i,
                ": src and dst rows differ in size, src ", describe(src), ", dst ", describe(dst));
    const torch::Tensor& index = job.src_row.defined() ? job.src_row : row_index;
    TORCH_CHECK(index.defined(), who, ": job ", i, " has no src_row and row_index is undefined");
    TORCH_CHECK(index.scalar_type() == torch::kLong && index.dim() == 1 && index.is_contiguous(), who, ": job ", i,
                ": the row index must be a contiguous int64 vector, got ", describe(index));
    TORCH_CHECK(index.numel() == R_dst, who, ": job ", i, ": the row index has ", index.numel(),
                " entries but dst has ", R_dst, " rows");
    TORCH_CHECK(index.device() == src.device(), who, ": job ", i, ": the row index is on ", index.device().str(),
                " but the tensors on ", src.device().str());
    TORCH_CHECK(R_src > 0 || R_dst == 0, who, ": job ", i, ": src has no rows but dst wants ", R_dst);
    out.push_back({src.view({R_src, row_elems}), dst.view({R_dst, row_elems}), index,
                   row_elems * static_cast<int64_t>(src.element_size())});
  }
  return out;
}

}  // namespace

void gather_rows_fused(const std::vector<GatherJob>& jobs, const torch::Tensor& row_index, cudaStream_t stream) {
  const std::vector<CheckedJob> checked = check_jobs(jobs, row_index, "gather_rows_fused", /*need_cuda=*/true);
  if (checked.empty()) return;
  std::vector<cuda::RowCopyJob> raw;
  raw.reserve(checked.size());
  for (const CheckedJob& c : checked) {
    raw.push_back(
        {c.src.data_ptr(), c.dst.data_ptr(), c.index.data_ptr<int64_t>(), c.src.size(0), c.dst.size(0), c.row_bytes});
  }
  // The caller orders `stream` after the producers of src and index (the allocator's streams).
  const c10::cuda::CUDAGuard device_guard(checked[0].src.device());
  const cudaError_t err = cuda::gather_rows_launch(raw.data(), static_cast<int>(raw.size()), stream);
  TORCH_CHECK(err == cudaSuccess, "gather_rows_fused: the gather kernel launch failed: ", cudaGetErrorString(err));
}

void gather_rows_aten(const std::vector<GatherJob>& jobs, const torch::Tensor& row_index, cudaStream_t stream) {
  const std::vector<CheckedJob> checked = check_jobs(jobs, row_index, "gather_rows_aten", /*need_cuda=*/false);
  if (checked.empty()) return;
  const torch::Device device = checked[0].src.device();
  std::optional<c10::cuda::CUDAStreamGuard> stream_guard;
  if (device.is_cuda()) stream_guard.emplace(c10::cuda::getStreamFromExternal(stream, device.index()));
  for (const CheckedJob& c : checked) {
    if (c.dst.numel() == 0) continue;
    torch::Tensor dst = c.dst;  // index_select_out takes a non-const out; dst is a view of the job's dst
    torch::index_select_out(dst, c.src, 0, c.index);
  }
}

}  // namespace collider::detail
