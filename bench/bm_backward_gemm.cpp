// Backward-GEMM micro-benchmarks: the paper's Figure 4 (sparse GEMM vs dimension-reduced dense GEMM).
// For every linear projection of TinyLlama-1.1B, Qwen2.5-1.5B and Phi-1.5 it times the two backward
// GEMMs, dX = dY·W and dW = dYᵀ·X, with the rows of filtered tokens handled five ways: dense (all T
// rows), torch sparse COO / CSR (dropped rows of dY zeroed), dimension-reduced dense on N kept rows,
// and the same with its gather (index_select of the kept rows, inside the timed region).
//   COLLIDER_BENCH_SCALE=cpu build/bench/bm_backward_gemm --benchmark_filter='model:tinyllama'
//       --benchmark_format=json --benchmark_out=bm.json     (then: python plots/fig_sparse_gemm.py)
// Scales: paper (T=2048, real widths; GPU) or cpu (T and every width divided by 4); see bench/README.md.
// Legend: T sequence, N kept rows, K input width of the projection, M output width (W_MK as in
// torch.nn.Linear: y_TM = x_TK · W_MKᵀ).
#include "bench_args.h"
#include "projections.h"

#include <torch/torch.h>

#include <benchmark/benchmark.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <fmt/format.h>

#include <cmath>
#include <cstdlib>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace collider::bench {
namespace {

// The paper models' projections (bench/projections.h).
const std::vector<Projection>& kProjections = paper_projections();
constexpr int64_t kPaperSeqLen = 2048;

// The declared axes. Dense does not depend on the filter ratio and runs once, at ratio 0.
const std::vector<std::string> kOps = {"dX", "dW"};
const std::vector<std::string> kMethods = {"dense", "sparse_coo", "sparse_csr", "reduced", "reduced_gather"};
const std::vector<int64_t> kRatiosPermille = {100, 200, 300, 400, 500, 600, 700, 800, 900, 950, 990};

struct Scale {
  std::string name;  // "cpu" or "paper"
  int64_t divisor;   // T and every width are divided by it
};

struct Case {
  Projection proj;
  std::string op;      // "dX" or "dW"
  std::string method;  // one of kMethods
  int64_t seq_len_T;
  int64_t in_K;
  int64_t out_M;
};

torch::Device bench_device() {
  return torch::cuda::is_available() ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
}

// bf16 on GPU (the paper's training dtype); fp32 on CPU, where bf16 GEMM is not representative.
// COLLIDER_BENCH_DTYPE=float32|bfloat16|float16 overrides.
torch::ScalarType bench_dtype() {
  const char* env = std::getenv("COLLIDER_BENCH_DTYPE");
  std::string name = env ? env : (torch::cuda::is_available() ? "bfloat16" : "float32");
  if (name == "float32") return torch::kFloat32;
  if (name == "bfloat16") return torch::kBFloat16;
  if (name == "float16") return torch::kFloat16;
  throw std::invalid_argument(
      fmt::format("COLLIDER_BENCH_DTYPE='{}' is not supported; use float32, bfloat16 or float16", name));
}

// Times one call of `fn` per benchmark iteration. On CUDA: device time between two events, as
// manual time (the benchmark is registered with UseManualTime). On CPU: the benchmark's own
// wall-clock timer (UseRealTime: torch's intra-op threads make CPU time meaningless).
template <typename Fn>
void run_timed(benchmark::State& state, const torch::Device& device, Fn&& fn) {
  if (device.is_cuda()) {
    c10::impl::VirtualGuardImpl guard(c10::DeviceType::CUDA);
    const c10::Stream stream = guard.getStream(device);
    // BACKEND_DEFAULT = cudaEventDefault (timing enabled); re-recorded every iteration.
    c10::Event start(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT);
    c10::Event stop(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT);
    for (auto _ : state) {
      start.record(stream);
      fn();
      stop.record(stream);
      stop.synchronize();
      state.SetIterationTime(start.elapsedTime(stop) / 1e3);  // elapsedTime is in ms
    }
  } else {
    for (auto _ : state) { fn(); }
  }
}

void bm_backward_gemm(benchmark::State& state, const Case& c) {
  const double filter_ratio = static_cast<double>(state.range(0)) / 1000.0;
  const torch::Device device = bench_device();
  const auto opts = torch::TensorOptions().dtype(bench_dtype()).device(device);
  const int64_t T = c.seq_len_T, K = c.in_K, M = c.out_M;
  // Drop count rounded up, at least one kept row (r = 0.99 at cpu scale keeps 6 of 512).
  const int64_t num_dropped = std::min<int64_t>(T - 1, static_cast<int64_t>(std::ceil(filter_ratio * T - 1e-9)));
  const int64_t N = T - num_dropped;

  torch::manual_seed(0);
  torch::Tensor x_TK = torch::randn({T, K}, opts);
  torch::Tensor W_MK = torch::randn({M, K}, opts) / std::sqrt(static_cast<double>(K));
  torch::Tensor dy_TM = torch::randn({T, M}, opts);
  // Kept rows: a random subset, in sequence order (what select_tokens returns).
  torch::Tensor idx_N =
      std::get<0>(torch::randperm(T, torch::TensorOptions().dtype(torch::kLong)).slice(0, 0, N).sort()).to(device);
  torch::Tensor keep_T = torch::zeros({T}, torch::TensorOptions().dtype(torch::kBool).device(device));
  keep_T.index_fill_(0, idx_N, true);
  torch::Tensor dy_masked_TM = dy_TM * keep_T.unsqueeze(1).to(dy_TM.dtype());
  torch::Tensor x_NK = x_TK.index_select(0, idx_N);
  torch::Tensor dy_NM = dy_TM.index_select(0, idx_N);

  // Outputs and gather buffers are allocated once, outside the timed loop.
  const bool is_dx = c.op == "dX";
  const bool is_reduced = c.method == "reduced" || c.method == "reduced_gather";
  const int64_t rows = c.method == "dense" ? T : N;  // rows of useful work
  // dX of dense and sparse has all T rows (zero rows included); the reduced GEMMs give only N.
  torch::Tensor out = is_dx ? torch::empty({is_reduced ? N : T, K}, opts) : torch::empty({M, K}, opts);
  torch::Tensor gathered_dy_NM = torch::empty({N, M}, opts);
  torch::Tensor gathered_x_NK = torch::empty({N, K}, opts);
  torch::Tensor sparse_lhs;  // dY (T x M) for dX, dYᵀ (M x T) for dW, dropped rows of dY zeroed
  std::function<void()> fn;

  try {
    if (c.method == "sparse_coo" || c.method == "sparse_csr") {
      torch::Tensor lhs = is_dx ? dy_masked_TM : dy_masked_TM.t().contiguous();
      // Conversion is outside the timed region: the figure compares the GEMMs themselves.
      sparse_lhs = c.method == "sparse_coo" ? lhs.to_sparse() : lhs.to_sparse_csr();
    }
    if (c.method == "dense") {
      fn = is_dx ? std::function<void()>([&] { torch::mm_out(out, dy_TM, W_MK); })
                 : std::function<void()>([&] { torch::mm_out(out, dy_TM.t(), x_TK); });
    } else if (c.method == "sparse_coo" || c.method == "sparse_csr") {
      fn = is_dx ? std::function<void()>([&] { torch::mm_out(out, sparse_lhs, W_MK); })
                 : std::function<void()>([&] { torch::mm_out(out, sparse_lhs, x_TK); });
    } else if (c.method == "reduced") {
      fn = is_dx ? std::function<void()>([&] { torch::mm_out(out, dy_NM, W_MK); })
                 : std::function<void()>([&] { torch::mm_out(out, dy_NM.t(), x_NK); });
    } else if (c.method == "reduced_gather") {
      fn = is_dx ? std::function<void()>([&] {
        torch::index_select_out(gathered_dy_NM, dy_TM, 0, idx_N);
        torch::mm_out(out, gathered_dy_NM, W_MK);
      })
                 : std::function<void()>([&] {
                     torch::index_select_out(gathered_dy_NM, dy_TM, 0, idx_N);
                     torch::index_select_out(gathered_x_NK, x_TK, 0, idx_N);
                     torch::mm_out(out, gathered_dy_NM.t(), gathered_x_NK);
                   });
    } else {
      throw std::invalid_argument(fmt::format("unknown method '{}'", c.method));
    }
    fn();  // one untimed call: surfaces unsupported (method, dtype, device) before timing
    if (device.is_cuda()) torch::cuda::synchronize();
  } catch (const std::exception& e) {
    state.SkipWithError(fmt::format("{} {} on {}: {}", c.method, c.op, device.str(), e.what()).c_str());
    return;
  }

  run_timed(state, device, fn);

  // Declared work: 2·rows·M·K FLOPs per GEMM, rows = T for dense and N (useful rows) otherwise,
  // so the FLOP/s column of sparse and gather variants is useful work per second.
  const double flops = 2.0 * static_cast<double>(rows) * static_cast<double>(M) * static_cast<double>(K);
  state.counters["flops"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["rows"] = static_cast<double>(rows);
  state.counters["filter_ratio"] = c.method == "dense" ? 0.0 : filter_ratio;
  state.SetLabel(
      fmt::format("{} {} {} {} T={} N={} K={} M={}", c.proj.model, c.proj.layer, c.op, c.method, T, rows, K, M));
}

// --collider_scale=cpu|paper, else COLLIDER_BENCH_SCALE, else paper on CUDA and cpu without.
// The flag is removed from argv so Google Benchmark does not reject it.
Scale parse_scale(int* argc, char** argv) {
  std::string name;
  if (const char* env = std::getenv("COLLIDER_BENCH_SCALE")) name = env;
  int out = 1;
  for (int i = 1; i < *argc; ++i) {
    std::string arg = argv[i];
    const std::string flag = "--collider_scale=";
    if (arg.rfind(flag, 0) == 0) {
      name = arg.substr(flag.size());
    } else {
      argv[out++] = argv[i];
    }
  }
  *argc = out;
  if (name.empty()) name = torch::cuda::is_available() ? "paper" : "cpu";
  if (name == "cpu") return {"cpu", 4};
  if (name == "paper") return {"paper", 1};
  throw std::invalid_argument(
      fmt::format("collider scale '{}' is not known; use --collider_scale=cpu (T and widths / 4) or paper", name));
}

void register_benchmarks(const Scale& scale, bool manual_time) {
  for (const Projection& p : kProjections) {
    for (const std::string& op : kOps) {
      for (const std::string& method : kMethods) {
        Case c{p, op, method, kPaperSeqLen / scale.divisor, p.in_K / scale.divisor, p.out_M / scale.divisor};
        // Name segments are key:value so that plots/fig_sparse_gemm.py can parse them.
        std::string name = fmt::format("bwd_gemm/model:{}/layer:{}/op:{}/method:{}", p.model, p.layer, op, method);
        auto* b = benchmark::RegisterBenchmark(name.c_str(), bm_backward_gemm, c)
                      ->ArgsProduct({method == "dense" ? std::vector<int64_t>{0} : kRatiosPermille})
                      ->ArgName("ratio_permille")
                      ->Unit(benchmark::kMillisecond);
        if (manual_time) {
          b->UseManualTime();
        } else {
          b->UseRealTime();
        }
      }
    }
  }
}

}  // namespace
}  // namespace collider::bench

int main(int argc, char** argv) {
  using namespace collider::bench;
  Scale scale;
  torch::ScalarType dtype;
  try {
    scale = parse_scale(&argc, argv);
    dtype = bench_dtype();
  } catch (const std::exception& e) {
    fmt::print(stderr, "bm_backward_gemm: {}\n", e.what());
    return 2;
  }
  std::vector<char*> args = with_default_warmup(argc, argv);
  int new_argc = argc_of(args);

  const torch::Device device = bench_device();
  benchmark::AddCustomContext("collider_scale", scale.name);
  benchmark::AddCustomContext("collider_seq_len", std::to_string(kPaperSeqLen / scale.divisor));
  benchmark::AddCustomContext("collider_width_divisor", std::to_string(scale.divisor));
  benchmark::AddCustomContext("collider_device", device.str());
  benchmark::AddCustomContext("collider_dtype", c10::toString(dtype));
  benchmark::AddCustomContext("collider_torch_version", TORCH_VERSION);
  benchmark::AddCustomContext("collider_num_threads", std::to_string(torch::get_num_threads()));
  register_benchmarks(scale, device.is_cuda());

  benchmark::Initialize(&new_argc, args.data());
  if (benchmark::ReportUnrecognizedArguments(new_argc, args.data())) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
