// Steady-clock and CUDA-event timers (see timer.h). The CUDA timer uses c10::Event, the
// device-generic wrapper over cudaEvent_t (ATen's CUDA backend creates it with timing enabled
// for EventFlag::BACKEND_DEFAULT), so this file needs no CUDA headers and builds on CPU-only
// machines; it is only instantiated when torch::cuda::is_available().
#include "harness/components/timer.h"

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <chrono>
#include <mutex>
#include <stdexcept>
#include <vector>

namespace collider::harness {

int64_t host_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

namespace {

class SteadyClockTimer final : public Timer {
 public:
  int64_t mark() override {
    const int64_t t = host_now_ns();
    std::lock_guard<std::mutex> lock(mu_);
    marks_.push_back(t);
    return static_cast<int64_t>(marks_.size()) - 1;
  }
  void synchronize() override {}
  double elapsed_ms(int64_t a, int64_t b) const override {
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(a >= 0 && b >= 0 && a < static_cast<int64_t>(marks_.size()) && b < static_cast<int64_t>(marks_.size()),
                "Timer::elapsed_ms: mark index out of range (", a, ", ", b, " of ", marks_.size(), ")");
    return static_cast<double>(marks_[b] - marks_[a]) * 1e-6;
  }
  void reset() override {
    std::lock_guard<std::mutex> lock(mu_);
    marks_.clear();
  }
  int64_t num_marks() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(marks_.size());
  }
  const char* kind() const override { return "steady_clock"; }

 private:
  mutable std::mutex mu_;
  std::vector<int64_t> marks_;
};

class CudaEventTimer final : public Timer {
 public:
  explicit CudaEventTimer(const torch::Device& device) : device_(device), guard_(c10::DeviceType::CUDA) {
    if (!device_.has_index()) device_ = torch::Device(torch::kCUDA, guard_.getDevice().index());
  }
  int64_t mark() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (used_ == static_cast<int64_t>(events_.size())) {
      // Events are pooled across steps: creation is not free, re-recording is.
      events_.push_back(std::make_unique<c10::Event>(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT));
    }
    events_[used_]->record(guard_.getStream(device_));
    return used_++;
  }
  void synchronize() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (used_ > 0) events_[used_ - 1]->synchronize();
  }
  double elapsed_ms(int64_t a, int64_t b) const override {
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(a >= 0 && b >= 0 && a < used_ && b < used_, "Timer::elapsed_ms: mark index out of range (", a, ", ", b,
                " of ", used_, ")");
    return events_[a]->elapsedTime(*events_[b]);
  }
  void reset() override {
    std::lock_guard<std::mutex> lock(mu_);
    used_ = 0;
  }
  int64_t num_marks() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return used_;
  }
  const char* kind() const override { return "cuda_event"; }

 private:
  torch::Device device_;
  c10::impl::VirtualGuardImpl guard_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<c10::Event>> events_;
  int64_t used_ = 0;
};

}  // namespace

std::unique_ptr<Timer> make_cpu_timer() { return std::make_unique<SteadyClockTimer>(); }

std::unique_ptr<Timer> make_cuda_timer(const torch::Device& device) {
  if (!torch::cuda::is_available()) {
    throw std::runtime_error("make_cuda_timer: CUDA is not available on this machine; use the steady-clock timer");
  }
  return std::make_unique<CudaEventTimer>(device);
}

std::unique_ptr<Timer> make_timer(const torch::Device& device) {
  return device.is_cuda() ? make_cuda_timer(device) : make_cpu_timer();
}

}  // namespace collider::harness
