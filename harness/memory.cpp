// Tracking CPU allocator and CUDA allocator statistics (memory.h). The tracking allocator keeps
// c10's contract that a CPU DataPtr's context is its data pointer (raw_allocate relies on it):
// sizes live in a side table keyed by pointer, and freeing goes through the default
// allocator's own deleter.
#include "harness/memory.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <unordered_map>

namespace collider::harness {
namespace {

class TrackingCpuAllocator final : public c10::Allocator {
 public:
  explicit TrackingCpuAllocator(c10::Allocator* inner) : inner_(inner), inner_free_(inner->raw_deleter()) {
    TORCH_CHECK(inner_free_ != nullptr, "tracking CPU allocator: the default CPU allocator has no raw deleter");
  }

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = inner_->allocate(n);
    void* p = inner.get();
    TORCH_CHECK(p == inner.get_context() || p == nullptr,
                "tracking CPU allocator: the default CPU allocator returned a wrapped pointer");
    inner.release_context();
    if (p) {
      std::lock_guard<std::mutex> lock(mu_);
      sizes_[p] = n;
      live_ += static_cast<int64_t>(n);
      peak_ = std::max(peak_, live_);
    }
    return {p, p, &TrackingCpuAllocator::free, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &TrackingCpuAllocator::free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  static void free(void* p) {
    if (!p) return;
    TrackingCpuAllocator* self = instance();
    {
      std::lock_guard<std::mutex> lock(self->mu_);
      auto it = self->sizes_.find(p);
      if (it != self->sizes_.end()) {
        self->live_ -= static_cast<int64_t>(it->second);
        self->sizes_.erase(it);
      }
    }
    self->inner_free_(p);
  }

  static TrackingCpuAllocator*& instance() {
    static TrackingCpuAllocator* inst = nullptr;
    return inst;
  }

  int64_t live() const {
    std::lock_guard<std::mutex> lock(mu_);
    return live_;
  }
  int64_t peak() const {
    std::lock_guard<std::mutex> lock(mu_);
    return peak_;
  }
  void reset_peak() {
    std::lock_guard<std::mutex> lock(mu_);
    peak_ = live_;
  }

 private:
  c10::Allocator* inner_;
  c10::DeleterFnPtr inner_free_;
  mutable std::mutex mu_;
  std::unordered_map<void*, size_t> sizes_;
  int64_t live_ = 0, peak_ = 0;
};

std::once_flag g_install_once;

}  // namespace

void install_cpu_memory_tracking() {
  std::call_once(g_install_once, [] {
    // Never freed: tensors may outlive main's locals and free through it at exit.
    auto* alloc = new TrackingCpuAllocator(c10::GetDefaultCPUAllocator());
    TrackingCpuAllocator::instance() = alloc;
    c10::SetCPUAllocator(alloc, /*priority=*/100);
  });
}

bool cpu_memory_tracking_installed() { return TrackingCpuAllocator::instance() != nullptr; }

MemoryProbe::MemoryProbe(const torch::Device& d) : device(d) {}

void MemoryProbe::reset_peak() {
  if (device.is_cuda()) {
    c10::getDeviceAllocator(c10::DeviceType::CUDA)->resetPeakStats(device.has_index() ? device.index() : 0);
  } else if (auto* a = TrackingCpuAllocator::instance()) {
    a->reset_peak();
  }
}

int64_t MemoryProbe::peak_bytes() const {
  if (device.is_cuda()) {
    auto stats = c10::getDeviceAllocator(c10::DeviceType::CUDA)->getDeviceStats(device.has_index() ? device.index() : 0);
    return stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak;
  }
  auto* a = TrackingCpuAllocator::instance();
  return a ? a->peak() : -1;
}

int64_t MemoryProbe::live_bytes() const {
  if (device.is_cuda()) {
    auto stats = c10::getDeviceAllocator(c10::DeviceType::CUDA)->getDeviceStats(device.has_index() ? device.index() : 0);
    return stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].current;
  }
  auto* a = TrackingCpuAllocator::instance();
  return a ? a->live() : -1;
}

const char* MemoryProbe::method() const {
  if (device.is_cuda()) return "cuda_caching_allocator_peak_allocated_bytes";
  return cpu_memory_tracking_installed() ? "cpu_tracking_allocator_peak_live_tensor_bytes" : "none";
}

}  // namespace collider::harness
