// NVTX ranges, the Chrome/Perfetto trace writer and the CUDA profiler capture range (ranges.h).
#include "harness/components/ranges.h"

#include "base/fsutil.h"
#include "harness/components/timer.h"

#include <dlfcn.h>

#include <cstdio>
#include <fstream>
#include <stdexcept>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#ifdef COLLIDER_HAVE_NVTX
#include <nvtx3/nvToolsExt.h>
#endif

namespace collider::harness {

#ifdef COLLIDER_HAVE_NVTX
namespace {
nvtxDomainHandle_t domain() {
  static nvtxDomainHandle_t d = nvtxDomainCreateA("collider");
  return d;
}
}  // namespace
bool nvtx_enabled() { return true; }
#else
bool nvtx_enabled() { return false; }
#endif

TraceWriter::TraceWriter(std::string path) : path_(std::move(path)), origin_ns_(host_now_ns()) {}

void TraceWriter::add(const std::string& name, int64_t begin_ns, int64_t end_ns, int64_t depth) {
  std::lock_guard<std::mutex> lock(mu_);
  events_.push_back({name, begin_ns, end_ns, depth});
}

int64_t TraceWriter::num_events() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(events_.size());
}

void TraceWriter::write() const {
  nlohmann::json events = nlohmann::json::array();
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", 1}, {"tid", 1}, {"args", {{"name", "collider"}}}});
  events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", 1}, {"tid", 1}, {"args", {{"name", "step"}}}});
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& e : events_) {
      // Microseconds with nanosecond resolution; durations from integer nanoseconds so that
      // a child never pokes out of its parent by rounding.
      events.push_back({{"name", e.name},
                        {"cat", "collider"},
                        {"ph", "X"},
                        {"ts", static_cast<double>(e.begin_ns - origin_ns_) / 1000.0},
                        {"dur", static_cast<double>(e.end_ns - e.begin_ns) / 1000.0},
                        {"pid", 1},
                        {"tid", 1},
                        {"args", {{"depth", e.depth}}}});
    }
  }
  nlohmann::json doc = {{"traceEvents", events},
                        {"displayTimeUnit", "ms"},
                        {"otherData", {{"producer", "collider run --trace"}, {"clock", "host steady_clock"}}}};
  fsutil::write_file_atomic(path_, doc.dump() + "\n");  // throws WriteError naming the file and errno
}

uint64_t RangeRecorder::begin(const std::string& name) {
  Open o{name, host_now_ns(), 0, 0};
#ifdef COLLIDER_HAVE_NVTX
  nvtxEventAttributes_t attr{};
  attr.version = NVTX_VERSION;
  attr.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
  attr.messageType = NVTX_MESSAGE_TYPE_ASCII;
  attr.message.ascii = name.c_str();
  o.nvtx_id = nvtxDomainRangeStartEx(domain(), &attr);
#endif
  std::lock_guard<std::mutex> lock(mu_);
  o.depth = static_cast<int64_t>(open_.size());
  const uint64_t h = next_++;
  open_.emplace(h, std::move(o));
  return h;
}

void RangeRecorder::end(uint64_t handle) {
  const int64_t now = host_now_ns();
  Open o;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = open_.find(handle);
    if (it == open_.end()) return;
    o = std::move(it->second);
    open_.erase(it);
  }
#ifdef COLLIDER_HAVE_NVTX
  nvtxDomainRangeEnd(domain(), o.nvtx_id);
#endif
  if (trace_) trace_->add(o.name, o.begin_ns, now, o.depth);
}

int64_t RangeRecorder::open_ranges() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(open_.size());
}

namespace {
using CudaProfilerFn = int (*)();
CudaProfilerFn find_cudart(const char* symbol) {
  if (void* f = dlsym(RTLD_DEFAULT, symbol)) return reinterpret_cast<CudaProfilerFn>(f);
  for (const char* lib : {"libcudart.so.13", "libcudart.so.12", "libcudart.so"}) {
    if (void* h = dlopen(lib, RTLD_NOW | RTLD_NOLOAD)) {
      if (void* f = dlsym(h, symbol)) return reinterpret_cast<CudaProfilerFn>(f);
    }
  }
  return nullptr;
}
}  // namespace

bool cuda_profiler_start() {
  if (!torch::cuda::is_available()) return false;
  auto f = find_cudart("cudaProfilerStart");
  return f && f() == 0;
}

bool cuda_profiler_stop() {
  if (!torch::cuda::is_available()) return false;
  auto f = find_cudart("cudaProfilerStop");
  return f && f() == 0;
}

}  // namespace collider::harness
