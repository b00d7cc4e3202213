// The library floor of the paper's Figure 4: the backward GEMMs of TinyLlama-1.1B's projections at
// T=2048 called on cuBLAS directly (no libtorch), full (T rows) and dimension-reduced (N kept rows),
// so the figure can show how close the rewritten backward gets through libtorch. dX = dY·W and
// dW = dYᵀ·X, bf16 inputs and outputs, fp32 accumulation (CUBLAS_COMPUTE_32F), two APIs:
// cublasGemmEx (method cublas_*) and cublasLt with its top heuristic and a 32 MiB workspace
// (cublaslt_*). Timed with CUDA events around each call (UseManualTime), as bench/bm_backward_gemm;
// before timing, five output elements are checked against a host dot product.
//   build/bench/bm_cublas_gemm --benchmark_out_format=json --benchmark_out=bm_cublas_gemm.json
//   build/bench/bm_cublas_gemm --benchmark_list_tests      (the names; works without a device)
// Without a CUDA device it prints why it skips and exits 0. Built only with COLLIDER_CUDA=ON.
// Legend: T sequence, N kept rows, K input width, M output width (W_MK: y_TM = x_TK · W_MKᵀ).
#include "bench_args.h"
#include "projections.h"

#include <benchmark/benchmark.h>
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace collider::bench {
namespace {

// Failing CUDA / cuBLAS calls throw with the call, file:line and the library's status.
void throw_status(const char* what, const char* call, const char* file, int line, const std::string& status) {
  throw std::runtime_error(std::string(what) + " call `" + call + "` failed at " + file + ":" + std::to_string(line) +
                           ": " + status);
}
#define COLLIDER_CUDA_CHECK(call)                                                                       \
  do {                                                                                                  \
    const cudaError_t err_ = (call);                                                                    \
    if (err_ != cudaSuccess) throw_status("CUDA", #call, __FILE__, __LINE__, cudaGetErrorString(err_)); \
  } while (0)
#define COLLIDER_CUBLAS_CHECK(call)                                                                  \
  do {                                                                                               \
    const cublasStatus_t st_ = (call);                                                               \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                                                \
      throw_status("cuBLAS", #call, __FILE__, __LINE__,                                              \
                   std::string(cublasGetStatusName(st_)) + " (" + cublasGetStatusString(st_) + ")"); \
  } while (0)

// TinyLlama-1.1B's projections (bench/projections.h), at the paper's T.
const std::vector<Projection> kProjections = projections_of("tinyllama-1.1b");
constexpr int64_t kSeqLen = 2048;
const std::vector<std::string> kOps = {"dX", "dW"};
// <api>_dense runs once at ratio 0; <api>_reduced at every filter ratio.
const std::vector<std::string> kApis = {"cublas", "cublaslt"};
const std::vector<int64_t> kRatiosPermille = {100, 200, 300, 400, 500, 600, 700, 800, 900, 950, 990};
constexpr size_t kLtWorkspaceBytes = 32u << 20;

// ---- RAII ----------------------------------------------------------------------------------------
struct CudaFree {
  void operator()(void* p) const { cudaFree(p); }
};
using DeviceBuffer = std::unique_ptr<void, CudaFree>;
DeviceBuffer device_alloc(size_t bytes) {
  void* p = nullptr;
  COLLIDER_CUDA_CHECK(cudaMalloc(&p, bytes));
  return DeviceBuffer(p);
}

struct StreamDeleter {
  void operator()(cudaStream_t s) const { cudaStreamDestroy(s); }
};
struct EventDeleter {
  void operator()(cudaEvent_t e) const { cudaEventDestroy(e); }
};
struct CublasDeleter {
  void operator()(cublasHandle_t h) const { cublasDestroy(h); }
};
struct LtDeleter {
  void operator()(cublasLtHandle_t h) const { cublasLtDestroy(h); }
};
struct LtDescDeleter {
  void operator()(cublasLtMatmulDesc_t d) const { cublasLtMatmulDescDestroy(d); }
};
struct LtLayoutDeleter {
  void operator()(cublasLtMatrixLayout_t l) const { cublasLtMatrixLayoutDestroy(l); }
};
struct LtPrefDeleter {
  void operator()(cublasLtMatmulPreference_t p) const { cublasLtMatmulPreferenceDestroy(p); }
};
using Stream = std::unique_ptr<std::remove_pointer_t<cudaStream_t>, StreamDeleter>;
using Event = std::unique_ptr<std::remove_pointer_t<cudaEvent_t>, EventDeleter>;
using Cublas = std::unique_ptr<std::remove_pointer_t<cublasHandle_t>, CublasDeleter>;
using CublasLt = std::unique_ptr<std::remove_pointer_t<cublasLtHandle_t>, LtDeleter>;
using LtDesc = std::unique_ptr<std::remove_pointer_t<cublasLtMatmulDesc_t>, LtDescDeleter>;
using LtLayout = std::unique_ptr<std::remove_pointer_t<cublasLtMatrixLayout_t>, LtLayoutDeleter>;
using LtPref = std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>, LtPrefDeleter>;

Event make_event() {
  cudaEvent_t e = nullptr;
  COLLIDER_CUDA_CHECK(cudaEventCreate(&e));  // default flags: timing enabled
  return Event(e);
}

// Everything the benchmarks share, made once in main(): handles, a stream, and bf16 buffers of the
// largest shapes (X [T, K], W [M, K], dY [T, M], out), filled once; a reduced GEMM reads the first
// N rows of X and dY (compact kept rows, what Collider's gradients hold). No allocation while timing.
struct Context {
  Stream stream;
  Cublas cublas;
  CublasLt lt;
  DeviceBuffer x_TK, W_MK, dy_TM, out, lt_workspace;
  std::vector<uint16_t> x_host, W_host, dy_host;  // the same bf16 values, for the result check
  cudaDeviceProp prop{};
  int cublas_version = 0;
};
Context* g_ctx = nullptr;

// bf16 of a float (round to nearest even), for the host-side fill.
uint16_t to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

float from_bf16(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

DeviceBuffer random_bf16(size_t count, uint32_t seed, float scale, std::vector<uint16_t>& host) {
  host.resize(count);
  uint32_t s = seed;
  for (auto& v : host) {
    s = s * 1664525u + 1013904223u;  // LCG: uniform in [-scale, scale)
    v = to_bf16((static_cast<float>(s >> 8) / 16777216.0f * 2.0f - 1.0f) * scale);
  }
  DeviceBuffer d = device_alloc(count * sizeof(uint16_t));
  COLLIDER_CUDA_CHECK(cudaMemcpy(d.get(), host.data(), count * sizeof(uint16_t), cudaMemcpyHostToDevice));
  return d;
}

std::unique_ptr<Context> make_context() {
  auto ctx = std::make_unique<Context>();
  COLLIDER_CUDA_CHECK(cudaSetDevice(0));
  COLLIDER_CUDA_CHECK(cudaGetDeviceProperties(&ctx->prop, 0));
  cudaStream_t s = nullptr;
  COLLIDER_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  ctx->stream.reset(s);
  cublasHandle_t h = nullptr;
  COLLIDER_CUBLAS_CHECK(cublasCreate(&h));
  ctx->cublas.reset(h);
  COLLIDER_CUBLAS_CHECK(cublasSetStream(h, s));
  COLLIDER_CUBLAS_CHECK(cublasGetVersion(h, &ctx->cublas_version));
  cublasLtHandle_t lt = nullptr;
  COLLIDER_CUBLAS_CHECK(cublasLtCreate(&lt));
  ctx->lt.reset(lt);
  int64_t max_K = 0, max_M = 0, max_MK = 0;
  for (const auto& p : kProjections) {
    max_K = std::max(max_K, p.in_K);
    max_M = std::max(max_M, p.out_M);
    max_MK = std::max(max_MK, p.in_K * p.out_M);
  }
  ctx->x_TK = random_bf16(static_cast<size_t>(kSeqLen * max_K), 1, 1.0f, ctx->x_host);
  ctx->W_MK = random_bf16(static_cast<size_t>(max_MK), 2, 1.0f / std::sqrt(static_cast<float>(max_K)), ctx->W_host);
  ctx->dy_TM = random_bf16(static_cast<size_t>(kSeqLen * max_M), 3, 1.0f, ctx->dy_host);
  ctx->out = device_alloc(static_cast<size_t>(std::max(kSeqLen * max_K, max_MK)) * sizeof(uint16_t));
  ctx->lt_workspace = device_alloc(kLtWorkspaceBytes);
  COLLIDER_CUDA_CHECK(cudaDeviceSynchronize());
  return ctx;
}

// ---- the GEMMs -----------------------------------------------------------------------------------
// Row-major tensors as column-major cuBLAS operands: C_rm = A_rm · B_rm is C_cmᵀ = B_cmᵀ · A_cmᵀ.
//   dX [rows, K] = dY [rows, M] · W [M, K]:  C (K x rows) = W (K x M, ld K) · dY (M x rows, ld M)
//   dW [M, K] = dYᵀ [M, rows] · X [rows, K]: C (K x M) = X (K x rows, ld K) · dY (M x rows, ld M)ᵀ
struct Gemm {
  cublasOperation_t op_b;
  int64_t m, n, k;
  const void* A;
  int64_t lda;
  const void* B;
  int64_t ldb;
  void* C;
  int64_t ldc;
};

Gemm make_gemm(const std::string& op, int64_t rows, int64_t K, int64_t M) {
  Context& c = *g_ctx;
  if (op == "dX") return {CUBLAS_OP_N, K, rows, M, c.W_MK.get(), K, c.dy_TM.get(), M, c.out.get(), K};
  return {CUBLAS_OP_T, K, M, rows, c.x_TK.get(), K, c.dy_TM.get(), M, c.out.get(), K};
}

void run_gemmex(const Gemm& g) {
  const float alpha = 1.0f, beta = 0.0f;
  COLLIDER_CUBLAS_CHECK(cublasGemmEx(g_ctx->cublas.get(), CUBLAS_OP_N, g.op_b, static_cast<int>(g.m),
                                     static_cast<int>(g.n), static_cast<int>(g.k), &alpha, g.A, CUDA_R_16BF,
                                     static_cast<int>(g.lda), g.B, CUDA_R_16BF, static_cast<int>(g.ldb), &beta, g.C,
                                     CUDA_R_16BF, static_cast<int>(g.ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// A cublasLt matmul with its descriptors and the heuristic's first algorithm, chosen once.
struct LtPlan {
  LtDesc desc;
  LtLayout a, b, c;
  cublasLtMatmulAlgo_t algo{};
};

LtLayout lt_layout(uint64_t rows, uint64_t cols, int64_t ld) {
  cublasLtMatrixLayout_t l = nullptr;
  COLLIDER_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l, CUDA_R_16BF, rows, cols, ld));
  return LtLayout(l);
}

LtPlan make_lt_plan(const Gemm& g) {
  LtPlan p;
  cublasLtMatmulDesc_t d = nullptr;
  COLLIDER_CUBLAS_CHECK(cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  p.desc.reset(d);
  const cublasOperation_t op_a = CUBLAS_OP_N;
  COLLIDER_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a));
  COLLIDER_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSB, &g.op_b, sizeof g.op_b));
  p.a = lt_layout(g.m, g.k, g.lda);  // A is m x k (not transposed)
  p.b = g.op_b == CUBLAS_OP_N ? lt_layout(g.k, g.n, g.ldb) : lt_layout(g.n, g.k, g.ldb);
  p.c = lt_layout(g.m, g.n, g.ldc);
  cublasLtMatmulPreference_t pref_raw = nullptr;
  COLLIDER_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref_raw));
  LtPref pref(pref_raw);
  const uint64_t ws = kLtWorkspaceBytes;
  COLLIDER_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref_raw, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  COLLIDER_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(g_ctx->lt.get(), d, p.a.get(), p.b.get(), p.c.get(), p.c.get(),
                                                       pref_raw, 1, &result, &found));
  if (found == 0) throw std::runtime_error("cublasLt heuristic found no algorithm for this GEMM");
  p.algo = result.algo;
  return p;
}

void run_lt(const Gemm& g, const LtPlan& p) {
  const float alpha = 1.0f, beta = 0.0f;
  COLLIDER_CUBLAS_CHECK(cublasLtMatmul(g_ctx->lt.get(), p.desc.get(), &alpha, g.A, p.a.get(), g.B, p.b.get(), &beta,
                                       g.C, p.c.get(), g.C, p.c.get(), &p.algo, g_ctx->lt_workspace.get(),
                                       kLtWorkspaceBytes, g_ctx->stream.get()));
}

// Five output elements (corners and middle) against a host dot product of the same bf16 inputs:
// catches a wrong operand mapping before any time is reported. Tolerance 2^-7 of the sum of
// |terms| (bf16 output rounding is 2^-8 of it at most).
void check_result(const std::string& op, int64_t rows, int64_t K, int64_t M) {
  const Context& c = *g_ctx;
  const int64_t out_rows = op == "dX" ? rows : M;
  const int64_t picks[5][2] = {{0, 0}, {0, K - 1}, {out_rows - 1, 0}, {out_rows - 1, K - 1}, {out_rows / 2, K / 2}};
  for (const auto& pick : picks) {
    const int64_t i = pick[0], j = pick[1];
    uint16_t got_bits = 0;
    COLLIDER_CUDA_CHECK(cudaMemcpy(&got_bits, static_cast<const uint16_t*>(c.out.get()) + i * K + j, sizeof got_bits,
                                   cudaMemcpyDeviceToHost));
    double ref = 0.0, mag = 0.0;
    const int64_t depth = op == "dX" ? M : rows;
    for (int64_t t = 0; t < depth; ++t) {
      // dX[i, j] = sum_m dY[i, m] W[m, j];  dW[i, j] = sum_r dY[r, i] X[r, j]
      const double term = op == "dX" ? double(from_bf16(c.dy_host[i * M + t])) * from_bf16(c.W_host[t * K + j])
                                     : double(from_bf16(c.dy_host[t * M + i])) * from_bf16(c.x_host[t * K + j]);
      ref += term;
      mag += std::fabs(term);
    }
    const double got = from_bf16(got_bits);
    if (std::fabs(got - ref) > mag / 128.0 + 1e-6) {
      throw std::runtime_error("result check failed at [" + std::to_string(i) + ", " + std::to_string(j) + "]: got " +
                               std::to_string(got) + ", host reference " + std::to_string(ref));
    }
  }
}

struct Case {
  Projection proj;
  std::string op;   // dX or dW
  std::string api;  // cublas or cublaslt
  bool reduced;     // N kept rows instead of T
};

void bm_cublas_gemm(benchmark::State& state, const Case& c) {
  const double filter_ratio = static_cast<double>(state.range(0)) / 1000.0;
  const int64_t T = kSeqLen, K = c.proj.in_K, M = c.proj.out_M;
  // Same rounding as bm_backward_gemm: drop count rounded up, at least one kept row.
  const int64_t num_dropped = std::min<int64_t>(T - 1, static_cast<int64_t>(std::ceil(filter_ratio * T - 1e-9)));
  const int64_t rows = c.reduced ? T - num_dropped : T;
  const std::string method = c.api + (c.reduced ? "_reduced" : "_dense");
  try {
    const Gemm g = make_gemm(c.op, rows, K, M);
    LtPlan plan;
    if (c.api == "cublaslt") plan = make_lt_plan(g);
    auto call = [&] {
      if (c.api == "cublaslt") {
        run_lt(g, plan);
      } else {
        run_gemmex(g);
      }
    };
    call();  // one untimed call: surfaces unsupported shapes / devices, and is checked
    COLLIDER_CUDA_CHECK(cudaStreamSynchronize(g_ctx->stream.get()));
    check_result(c.op, rows, K, M);
    const Event start = make_event(), stop = make_event();
    for (auto _ : state) {
      COLLIDER_CUDA_CHECK(cudaEventRecord(start.get(), g_ctx->stream.get()));
      call();
      COLLIDER_CUDA_CHECK(cudaEventRecord(stop.get(), g_ctx->stream.get()));
      COLLIDER_CUDA_CHECK(cudaEventSynchronize(stop.get()));
      float ms = 0.0f;
      COLLIDER_CUDA_CHECK(cudaEventElapsedTime(&ms, start.get(), stop.get()));
      state.SetIterationTime(static_cast<double>(ms) / 1e3);
    }
  } catch (const std::exception& e) {
    state.SkipWithError((method + " " + c.op + ": " + e.what()).c_str());
    return;
  }
  // Declared work 2·rows·M·K per GEMM (rows = T dense, N reduced), as in bm_backward_gemm.
  const double flops = 2.0 * static_cast<double>(rows) * static_cast<double>(M) * static_cast<double>(K);
  state.counters["flops"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["rows"] = static_cast<double>(rows);
  state.counters["filter_ratio"] = c.reduced ? filter_ratio : 0.0;
  state.SetLabel(std::string(c.proj.model) + " " + c.proj.layer + " " + c.op + " " + method +
                 " T=" + std::to_string(T) + " N=" + std::to_string(rows) + " K=" + std::to_string(K) +
                 " M=" + std::to_string(M));
}

void register_benchmarks() {
  for (const Projection& p : kProjections) {
    for (const std::string& op : kOps) {
      for (const std::string& api : kApis) {
        for (bool reduced : {false, true}) {
          // key:value segments, parsed like bm_backward_gemm's by plots/fig_sparse_gemm.py.
          const std::string name = std::string("cublas_gemm/model:") + p.model + "/layer:" + p.layer + "/op:" + op +
                                   "/method:" + api + (reduced ? "_reduced" : "_dense");
          benchmark::RegisterBenchmark(name.c_str(), bm_cublas_gemm, Case{p, op, api, reduced})
              ->ArgsProduct({reduced ? kRatiosPermille : std::vector<int64_t>{0}})
              ->ArgName("ratio_permille")
              ->Unit(benchmark::kMillisecond)
              ->UseManualTime();
        }
      }
    }
  }
}

}  // namespace
}  // namespace collider::bench

int main(int argc, char** argv) {
  using namespace collider::bench;
  const bool list_only = has_flag(argc, argv, "--benchmark_list_tests");
  int num_devices = 0;
  const cudaError_t dev_err = cudaGetDeviceCount(&num_devices);
  if (!list_only && (dev_err != cudaSuccess || num_devices == 0)) {
    std::printf(
        "bm_cublas_gemm: skipped: no usable CUDA device (cudaGetDeviceCount: %s). It times cuBLAS GEMMs on a GPU; nothing to "
        "measure here (--benchmark_list_tests lists the benchmarks).\n",
        dev_err != cudaSuccess ? cudaGetErrorString(dev_err) : "cudaGetDeviceCount found 0 devices");
    return 0;
  }
  std::vector<char*> args = with_default_warmup(argc, argv);  // 0.2 s burn-in unless the user sets one
  int new_argc = argc_of(args);

  std::unique_ptr<Context> ctx;
  if (!list_only) {
    try {
      ctx = make_context();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "bm_cublas_gemm: setting up the device failed: %s\n", e.what());
      return 1;
    }
    g_ctx = ctx.get();
    int runtime = 0;
    cudaRuntimeGetVersion(&runtime);
    benchmark::AddCustomContext("collider_device", std::string("cuda:0 ") + ctx->prop.name);
    benchmark::AddCustomContext("collider_compute_capability",
                                std::to_string(ctx->prop.major) + "." + std::to_string(ctx->prop.minor));
    benchmark::AddCustomContext("collider_cublas_version", std::to_string(ctx->cublas_version));
    benchmark::AddCustomContext("collider_cuda_runtime_version", std::to_string(runtime));
  }
  benchmark::AddCustomContext("collider_scale", "paper");
  benchmark::AddCustomContext("collider_seq_len", std::to_string(kSeqLen));
  benchmark::AddCustomContext("collider_width_divisor", "1");
  benchmark::AddCustomContext("collider_dtype", "bfloat16 (fp32 accumulate)");
  benchmark::AddCustomContext("collider_gemm_library", "cuBLAS (cublasGemmEx, cublasLt)");
  register_benchmarks();

  benchmark::Initialize(&new_argc, args.data());
  if (benchmark::ReportUnrecognizedArguments(new_argc, args.data())) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  g_ctx = nullptr;
  ctx.reset();  // handles and buffers freed while the CUDA runtime is still up
  return 0;
}
