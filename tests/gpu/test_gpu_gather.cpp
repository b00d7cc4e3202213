// The fused multi-tensor row gather (collider_core/src/cuda/gather_rows.*) against
// index_select (label gpu). Copies are bit-exact, so every comparison is torch::equal. Without a
// CUDA device the copy tests skip; the launch planning (vector width, blocks, launches) and the
// argument checks run anyway. In a build without the CUDA sources (COLLIDER_CUDA=OFF) the file is
// one skipped test. Run: build/tests/test_gpu_gather   (on a GPU: scripts/device/run_gpu_checks.sh)
// Legend: B batch, T sequence, N kept tokens, H heads, E head-dim, D hidden; R rows.
#include <gtest/gtest.h>
#include <torch/torch.h>

#ifndef COLLIDER_WITH_CUDA

TEST(GpuGather, BuildHasNoCudaSources) {
  GTEST_SKIP() << "this build has no CUDA sources (configure with the cuda preset, -DCOLLIDER_CUDA=ON, "
                  "to compile collider_core/src/cuda/)";
}

#else

#include "../../collider_core/src/cuda/gather_rows.h"
#include "../../collider_core/src/cuda/gather_rows_kernel.h"

#include <c10/cuda/CUDAStream.h>

#include <functional>
#include <string>
#include <vector>

using collider::detail::GatherJob;
using collider::detail::gather_rows_aten;
using collider::detail::gather_rows_fused;
namespace kernel = collider::detail::cuda;

namespace {

#define SKIP_WITHOUT_CUDA() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device"

// `fn` throws a c10::Error whose message contains `part`.
void expect_error(const std::function<void()>& fn, const std::string& part) {
  try {
    fn();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << "message: " << e.what();
    return;
  }
  ADD_FAILURE() << "no error; expected one mentioning '" << part << "'";
}

// R_dst source rows in [0, R_src): a sorted subset without repeats when R_dst <= R_src and
// `subset`, else random rows with repeats in any order (the kernel takes any index).
torch::Tensor random_rows(int64_t R_src, int64_t R_dst, bool subset, const torch::Device& device) {
  torch::Tensor idx;
  if (subset && R_dst <= R_src) {
    idx = std::get<0>(torch::randperm(R_src, torch::kLong).slice(0, 0, R_dst).sort());
  } else {
    idx = torch::randint(R_src, {R_dst}, torch::kLong);
  }
  return idx.to(device);
}

torch::Tensor random_tensor(std::vector<int64_t> sizes, torch::ScalarType dtype, const torch::Device& device) {
  if (dtype == torch::kUInt8) return torch::randint(256, sizes, torch::TensorOptions(dtype)).to(device);
  if (dtype == torch::kLong)
    return torch::randint(-(1LL << 40), 1LL << 40, sizes, torch::TensorOptions(dtype)).to(device);
  return torch::randn(sizes).to(dtype).to(device);
}

// dst = index_select for every job, on the device of the jobs.
void expect_gathered(const std::vector<GatherJob>& jobs, const torch::Tensor& row_index) {
  for (size_t i = 0; i < jobs.size(); ++i) {
    const auto& j = jobs[i];
    const torch::Tensor& idx = j.src_row.defined() ? j.src_row : row_index;
    torch::Tensor want = j.src.index_select(0, idx);
    EXPECT_TRUE(torch::equal(j.dst.cpu(), want.cpu())) << "job " << i << ": " << c10::toString(j.src.scalar_type())
                                                       << " src " << j.src.sizes() << " -> " << j.dst.sizes();
  }
}

GatherJob make_job(std::vector<int64_t> src_sizes, int64_t R_dst, torch::ScalarType dtype, const torch::Device& device,
                   bool own_index, bool subset = true) {
  GatherJob j;
  j.src = random_tensor(src_sizes, dtype, device);
  std::vector<int64_t> dst_sizes = src_sizes;
  dst_sizes[0] = R_dst;
  j.dst = torch::full(dst_sizes, 7, torch::TensorOptions(dtype).device(device));  // not the answer
  if (own_index) j.src_row = random_rows(src_sizes[0], R_dst, subset, device);
  return j;
}

// ---- launch planning: host code of gather_rows.cu, no device needed ------------------------------

TEST(GatherPlan, VectorWidthFollowsAlignment) {
  auto p = [](uintptr_t a) { return reinterpret_cast<void*>(a); };
  EXPECT_EQ(kernel::choose_vector_bytes(p(0x1000), p(0x2000), 4096), 16);  // bf16 row of 2048
  EXPECT_EQ(kernel::choose_vector_bytes(p(0x1000), p(0x2000), 24), 8);     // fp32 row of 6
  EXPECT_EQ(kernel::choose_vector_bytes(p(0x1000), p(0x2000), 12), 4);     // fp32 row of 3
  EXPECT_EQ(kernel::choose_vector_bytes(p(0x1000), p(0x2000), 14), 2);     // bf16 row of 7
  EXPECT_EQ(kernel::choose_vector_bytes(p(0x1000), p(0x2000), 13), 1);     // uint8 row of 13
  EXPECT_EQ(kernel::choose_vector_bytes(p(0x1004), p(0x2000), 4096), 4);   // src offset by one fp32
  EXPECT_EQ(kernel::choose_vector_bytes(p(0x1000), p(0x2002), 4096), 2);   // dst offset by one bf16
}

TEST(GatherPlan, BlocksAndLaunches) {
  const int64_t per_block = static_cast<int64_t>(kernel::kGatherThreads) * kernel::kGatherVectorsPerThread;
  auto p = [](uintptr_t a) { return reinterpret_cast<void*>(a); };
  kernel::RowCopyJob big{p(0x1000), p(0x2000), nullptr, 2048, 1229, 4096};  // 1229 rows of 256 vectors
  EXPECT_EQ(kernel::count_gather_blocks(big), (1229 * 256 + per_block - 1) / per_block);
  kernel::RowCopyJob odd{p(0x1000), p(0x2000), nullptr, 97, 5, 13};  // 65 one-byte vectors
  EXPECT_EQ(kernel::count_gather_blocks(odd), 1);
  kernel::RowCopyJob empty{p(0x1000), p(0x2000), nullptr, 97, 0, 4096};
  EXPECT_EQ(kernel::count_gather_blocks(empty), 0);
  kernel::RowCopyJob no_bytes{p(0x1000), p(0x2000), nullptr, 97, 5, 0};
  EXPECT_EQ(kernel::count_gather_blocks(no_bytes), 0);

  std::vector<kernel::RowCopyJob> jobs(kernel::kMaxJobsPerLaunch, odd);
  EXPECT_EQ(kernel::count_gather_launches(jobs.data(), 0), 0);
  EXPECT_EQ(kernel::count_gather_launches(jobs.data(), static_cast<int>(jobs.size())), 1);
  jobs.insert(jobs.begin() + 3, 10, empty);  // empty jobs take no slot
  EXPECT_EQ(kernel::count_gather_launches(jobs.data(), static_cast<int>(jobs.size())), 1);
  jobs.push_back(big);
  EXPECT_EQ(kernel::count_gather_launches(jobs.data(), static_cast<int>(jobs.size())), 2);
  std::vector<kernel::RowCopyJob> many(3 * kernel::kMaxJobsPerLaunch + 1, odd);
  EXPECT_EQ(kernel::count_gather_launches(many.data(), static_cast<int>(many.size())), 4);
}

// ---- argument checks (shared by both functions; run on CPU tensors) ------------------------------

TEST(GatherChecks, FusedRefusesCpuTensors) {
  const torch::Device cpu(torch::kCPU);
  std::vector<GatherJob> jobs = {make_job({10, 4}, 3, torch::kFloat, cpu, true)};
  expect_error([&] { gather_rows_fused(jobs, {}, nullptr); }, "needs CUDA tensors");
}

TEST(GatherChecks, ContractViolationsAreNamed) {
  const torch::Device cpu(torch::kCPU);
  auto base = [&] { return make_job({10, 4}, 3, torch::kFloat, cpu, true); };
  auto run = [](std::vector<GatherJob> jobs, torch::Tensor row_index = {}) {
    return [jobs, row_index] { gather_rows_aten(jobs, row_index, nullptr); };
  };
  GatherJob j = base();
  j.dst = torch::zeros({3, 5});
  expect_error(run({j}), "rows differ in size");
  j = base();
  j.dst = torch::zeros({3, 4}, torch::kDouble);
  expect_error(run({j}), "one dtype and device");
  j = base();
  j.src_row = torch::tensor({0, 1}, torch::kLong);
  expect_error(run({j}), "has 2 entries but dst has 3 rows");
  j = base();
  j.src_row = torch::tensor({0, 1, 2}, torch::kInt);
  expect_error(run({j}), "contiguous int64 vector");
  j = base();
  j.src_row = torch::Tensor();
  expect_error(run({j}), "row_index is undefined");
  j = base();
  j.src = torch::zeros({4, 10}).t();
  expect_error(run({j}), "must be contiguous");
  j = base();
  j.dst = j.src.narrow(0, 0, 3);
  expect_error(run({j}), "shares storage");
  j = base();
  j.src = torch::zeros({0, 4});
  expect_error(run({j}), "src has no rows");
  j = base();
  j.src = torch::zeros({});
  expect_error(run({j}), "rows along dim 0");
  j = base();
  j.src_row = torch::Tensor();
  expect_error(run({j}, torch::zeros({3, 1}, torch::kLong)), "row_index must be");
  GatherJob ok = base();
  expect_error(run({ok, j}), "job 1");  // the message names the failing job
}

TEST(GatherAten, MatchesIndexSelectOnCpu) {
  torch::manual_seed(1);
  const torch::Device cpu(torch::kCPU);
  torch::Tensor row_index = random_rows(97, 41, true, cpu);
  std::vector<GatherJob> jobs = {
      make_job({97, 64}, 41, torch::kFloat, cpu, false),                  // shared index
      make_job({97, 7}, 41, torch::kBFloat16, cpu, false),                // odd row bytes (14)
      make_job({97, 3, 5}, 41, torch::kUInt8, cpu, false),                // multi-dim rows of 15 bytes
      make_job({13, 9}, 30, torch::kFloat, cpu, true, /*subset=*/false),  // own index, repeats
      make_job({5, 4}, 0, torch::kFloat, cpu, true),                      // no rows kept
  };
  gather_rows_aten(jobs, row_index, nullptr);
  expect_gathered(jobs, row_index);
}

// ---- the kernel (CUDA device needed) -------------------------------------------------------------

// One fused call over jobs of every dtype and awkward row size (T = 97, 1025 as in STYLE.md).
TEST(FusedGather, MatchesIndexSelectAcrossDtypesAndRowSizes) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(2);
  const torch::Device dev(torch::kCUDA);
  const std::vector<torch::ScalarType> dtypes = {torch::kFloat, torch::kBFloat16, torch::kHalf, torch::kUInt8,
                                                 torch::kLong};
  const std::vector<std::vector<int64_t> > rows = {{1}, {3}, {7}, {64}, {2049}, {4, 5}, {5632}};
  for (int64_t R_src : {1, 97, 1025, 2048}) {
    for (bool own_index : {false, true}) {
      const int64_t R_dst = std::max<int64_t>(1, R_src * 3 / 5);
      torch::Tensor row_index = random_rows(R_src, R_dst, true, dev);
      std::vector<GatherJob> jobs;
      for (auto dtype : dtypes) {
        for (const auto& row : rows) {
          std::vector<int64_t> sizes = {R_src};
          sizes.insert(sizes.end(), row.begin(), row.end());
          jobs.push_back(make_job(sizes, R_dst, dtype, dev, own_index, /*subset=*/R_src != 97));
        }
      }
      ASSERT_GT(jobs.size(), static_cast<size_t>(kernel::kMaxJobsPerLaunch));  // more than one launch
      gather_rows_fused(jobs, row_index, c10::cuda::getCurrentCUDAStream().stream());
      expect_gathered(jobs, row_index);
    }
  }
}

// Base pointers off 16-byte alignment take narrower vectors; the result must not change.
TEST(FusedGather, MisalignedBasePointers) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(3);
  const torch::Device dev(torch::kCUDA);
  torch::Tensor row_index = random_rows(97, 50, true, dev);
  std::vector<GatherJob> jobs;
  for (int64_t offset : {1, 2, 3, 8}) {
    GatherJob j;
    j.src = random_tensor({97 * 64 + offset}, torch::kBFloat16, dev).narrow(0, offset, 97 * 64).view({97, 64});
    j.dst = torch::zeros({50 * 64 + offset}, torch::TensorOptions(torch::kBFloat16).device(dev))
                .narrow(0, offset, 50 * 64)
                .view({50, 64});
    EXPECT_LT(kernel::choose_vector_bytes(j.src.data_ptr(), j.dst.data_ptr(), 128), 16);
    jobs.push_back(j);
  }
  gather_rows_fused(jobs, row_index, c10::cuda::getCurrentCUDAStream().stream());
  expect_gathered(jobs, row_index);
}

TEST(FusedGather, EmptyJobsAreSkipped) {
  SKIP_WITHOUT_CUDA();
  const torch::Device dev(torch::kCUDA);
  std::vector<GatherJob> jobs = {make_job({16, 8}, 0, torch::kFloat, dev, true),  // no kept rows
                                 make_job({16, 0}, 5, torch::kFloat, dev, true),  // rows of 0 bytes
                                 make_job({16, 8}, 5, torch::kFloat, dev, true)};
  gather_rows_fused(jobs, {}, c10::cuda::getCurrentCUDAStream().stream());
  gather_rows_fused({}, {}, c10::cuda::getCurrentCUDAStream().stream());  // no jobs: nothing to launch
  expect_gathered(jobs, {});
}

// The saved tensors of one decoder layer, cut as TokenIndex cuts them: [B*T, D] rows with the flat
// kept-token index, [B*H*T, E] rows with the index repeated per head; fused == ATen reference.
TEST(FusedGather, OneLayerOfSavedTensorsOnAStream) {
  SKIP_WITHOUT_CUDA();
  torch::manual_seed(4);
  const torch::Device dev(torch::kCUDA);
  const int64_t B = 2, T = 1025, N = 615, H = 4, G = 2, E = 64, D = H * E, F = 704;
  torch::Tensor idx_BN = std::get<0>(std::get<1>(torch::rand({B, T}).topk(N, 1)).sort(1)).to(dev);  // [B, N]
  auto flat_rows = [&](int64_t rows_per_batch) {  // [B*rpb*N] indices into [B*rpb*T] rows
    auto base = torch::arange(B * rows_per_batch, idx_BN.options()).mul_(T).view({B, rows_per_batch, 1});
    return (base + idx_BN.view({B, 1, N})).reshape({-1}).contiguous();
  };
  struct Saved {
    std::vector<int64_t> sizes;  // as rows: [R_src, row...]
    int64_t rows_per_batch;
  };
  const std::vector<Saved> saved = {
      {{B * T, D}, 1}, {{B * H * T, E}, H}, {{B * G * T, E}, G}, {{B * G * T, E}, G},
      {{B * T, F}, 1}, {{B * T, F}, 1},     {{B * H, T}, H}};  // the last: per-head log-sum-exp rows
  std::vector<GatherJob> fused, reference;
  for (const Saved& s : saved) {
    for (auto dtype : {torch::kBFloat16, torch::kFloat}) {
      GatherJob j = make_job(s.sizes, 0, dtype, dev, false);
      if (s.sizes[0] == B * H && s.sizes[1] == T) {  // cut along columns: a transposed copy as rows
        j.src = j.src.view({B * H, T}).t().contiguous().view({T, B * H});
        j.src_row = idx_BN[0].contiguous();
        j.dst = torch::empty({N, B * H}, j.src.options());
      } else {
        j.src_row = flat_rows(s.rows_per_batch);
        std::vector<int64_t> dst_sizes = s.sizes;
        dst_sizes[0] = j.src_row.numel();
        j.dst = torch::empty(dst_sizes, j.src.options());
      }
      fused.push_back(j);
      GatherJob r = j;
      r.dst = torch::empty_like(j.dst);
      reference.push_back(r);
    }
  }
  c10::cuda::CUDAStream stream = c10::cuda::getStreamFromPool();
  torch::cuda::synchronize();  // the inputs were made on the default stream
  gather_rows_fused(fused, {}, stream.stream());
  gather_rows_aten(reference, {}, stream.stream());
  stream.synchronize();
  for (size_t i = 0; i < fused.size(); ++i) {
    EXPECT_TRUE(torch::equal(fused[i].dst, reference[i].dst)) << "saved tensor " << i << " " << fused[i].src.sizes();
  }
  expect_gathered(fused, {});
}

}  // namespace

#endif  // COLLIDER_WITH_CUDA
