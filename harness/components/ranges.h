// Named time ranges for profiling: every range goes to NVTX (domain "collider", when the NVTX3
// headers were found at build time: COLLIDER_HAVE_NVTX) and, when a trace file is requested
// (`collider run ... --trace FILE`), into a Chrome/Perfetto trace JSON, so the same per-layer
// picture (layer.07.fwd, layer.07.bwd, filter, optimizer, ...) exists on any machine.
// Ranges use start/end ids, not push/pop, because backward ranges open and close on the
// autograd engine's thread on CUDA. Trace timestamps are host steady-clock times (on CUDA:
// when the work was issued; the GPU durations are in the result rows).
// Tests: tests/test_trace.cpp.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace collider::harness {

// Collects complete ranges ("X" events) and writes {"traceEvents": [...]} JSON (open it in
// ui.perfetto.dev or chrome://tracing). write() rewrites the file atomically (temp + rename).
class TraceWriter {
 public:
  explicit TraceWriter(std::string path);
  void add(const std::string& name, int64_t begin_ns, int64_t end_ns, int64_t depth);
  void write() const;  // safe to call repeatedly (after every sweep point)
  const std::string& path() const { return path_; }
  int64_t num_events() const;

 private:
  struct Event {
    std::string name;
    int64_t begin_ns, end_ns, depth;
  };
  std::string path_;
  int64_t origin_ns_;
  mutable std::mutex mu_;
  std::vector<Event> events_;
};

// Opens and closes named ranges on NVTX and the optional trace. Thread-safe.
class RangeRecorder {
 public:
  explicit RangeRecorder(TraceWriter* trace = nullptr) : trace_(trace) {}
  void set_trace(TraceWriter* trace) { trace_ = trace; }
  uint64_t begin(const std::string& name);
  void end(uint64_t handle);
  int64_t open_ranges() const;

 private:
  struct Open {
    std::string name;
    int64_t begin_ns;
    uint64_t nvtx_id;
    int64_t depth;
  };
  TraceWriter* trace_;
  mutable std::mutex mu_;
  uint64_t next_ = 1;
  std::map<uint64_t, Open> open_;
};

// RAII range; a null recorder makes it a no-op.
class ScopedRange {
 public:
  ScopedRange(RangeRecorder* r, const std::string& name) : r_(r), h_(r ? r->begin(name) : 0) {}
  ~ScopedRange() { close(); }
  void close() {
    if (r_ && h_) r_->end(h_);
    h_ = 0;
  }
  ScopedRange(const ScopedRange&) = delete;
  ScopedRange& operator=(const ScopedRange&) = delete;

 private:
  RangeRecorder* r_;
  uint64_t h_;
};

// cudaProfilerStart/Stop (the capture range of `nsys --capture-range=cudaProfilerApi`), looked
// up at run time in the CUDA runtime that libtorch loaded; returns false (and does nothing)
// when no CUDA runtime is loaded.
bool cuda_profiler_start();
bool cuda_profiler_stop();

// True when NVTX ranges are compiled in.
bool nvtx_enabled();

}  // namespace collider::harness
