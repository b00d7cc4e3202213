// Tracking (and caching) CPU allocator and CUDA allocator statistics (memory.h). The tracking
// allocator keeps c10's contract that a CPU DataPtr's context is its data pointer (raw_allocate
// relies on it): sizes live in a side table keyed by pointer, and freeing goes through the
// default allocator's own deleter. Caching: freed blocks of >= 64 KiB are kept in a free list
// (capacity rounded up to 64 KiB below 1 MiB, to 1 MiB above) and handed out again, as CUDA's
// caching allocator does; glibc would munmap them (or trim its heap) and every step would
// page-fault fresh zeroed memory in again (a [304, 512] fp32 gather: 0.16 ms fresh, 0.03 reused).
#include "measuring/memory.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <unistd.h>

namespace collider::memory {
namespace {

class TrackingCpuAllocator final : public c10::Allocator {
 public:
  TrackingCpuAllocator(c10::Allocator* inner, bool caching, size_t cache_limit)
      : inner_(inner), inner_free_(inner->raw_deleter()), caching_(caching), cache_limit_(cache_limit) {
    TORCH_CHECK(inner_free_ != nullptr, "tracking CPU allocator: the default CPU allocator has no raw deleter");
  }

  c10::DataPtr allocate(size_t n) override {
    void* p = nullptr;
    size_t cap = n;
    if (caching_ && n >= kCacheMin) {
      cap = capacity_class(n);
      std::lock_guard<std::mutex> lock(mu_);
      // Best fit among cached blocks no more than 1/8 larger than asked (bounded waste).
      auto it = free_.lower_bound(cap);
      if (it != free_.end() && it->first <= cap + cap / 8) {
        p = it->second.ptr;
        cap = it->first;
        uncache(it);
        note_live(p, n, cap);
      }
    }
    if (!p) {
      p = inner_allocate(cap);
      if (p) {
        std::lock_guard<std::mutex> lock(mu_);
        note_live(p, n, cap);
      }
    }
    return {p, p, &TrackingCpuAllocator::free, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &TrackingCpuAllocator::free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }

  // A freed block is cached; when the cache would outgrow its limit, the blocks cached longest
  // ago are given back first (least recently freed): they belong to shapes no longer in use, and
  // the block just freed is the one the next step asks for again. (Refusing the new block
  // instead kept stale shapes forever: a benchmark interleaving seven methods at T = 1024 filled
  // the 8 GiB cache and the last methods of each round page-faulted every block.)
  static void free(void* p) {
    if (!p) return;
    TrackingCpuAllocator* self = instance();
    std::vector<void*> evicted;
    {
      std::lock_guard<std::mutex> lock(self->mu_);
      auto it = self->sizes_.find(p);
      if (it != self->sizes_.end()) {
        const Block b = it->second;
        self->live_ -= static_cast<int64_t>(b.bytes);
        self->sizes_.erase(it);
        if (self->caching_ && b.capacity >= kCacheMin && b.capacity <= self->cache_limit_) {
          while (self->cached_ + b.capacity > self->cache_limit_) {
            auto oldest = self->by_age_.begin()->second;
            evicted.push_back(oldest->second.ptr);
            self->uncache(oldest);
          }
          auto at = self->free_.emplace(b.capacity, Cached{p, self->next_age_});
          self->by_age_.emplace(self->next_age_++, at);
          self->cached_ += b.capacity;
          p = nullptr;
        }
      }
    }
    for (void* e : evicted) self->inner_free_(e);
    if (p) self->inner_free_(p);
  }

  // Returns every cached block to the system allocator.
  void release_cached() {
    std::multimap<size_t, Cached> blocks;
    {
      std::lock_guard<std::mutex> lock(mu_);
      blocks.swap(free_);
      by_age_.clear();
      cached_ = 0;
    }
    for (auto& [cap, c] : blocks) inner_free_(c.ptr);
  }
  bool caching() const { return caching_; }
  size_t cache_limit() const { return cache_limit_; }

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
  static constexpr size_t kCacheMin = size_t(64) << 10;
  static constexpr size_t kLargeClass = size_t(1) << 20;
  static size_t capacity_class(size_t n) {  // n >= kCacheMin
    const size_t unit = n < kLargeClass ? kCacheMin : kLargeClass;
    return (n + unit - 1) / unit * unit;
  }
  struct Block {
    size_t bytes;     // what the tensor asked for (counted as live)
    size_t capacity;  // what the block holds
  };

  void note_live(void* p, size_t n, size_t cap) {  // mu_ held
    sizes_[p] = {n, cap};
    live_ += static_cast<int64_t>(n);
    peak_ = std::max(peak_, live_);
  }

  void* inner_allocate(size_t n) {
    c10::DataPtr inner;
    try {
      inner = inner_->allocate(n);
    } catch (const c10::Error&) {
      if (!caching_) throw;
      release_cached();  // out of memory with blocks cached: give them back and try once more
      inner = inner_->allocate(n);
    }
    void* p = inner.get();
    TORCH_CHECK(p == inner.get_context() || p == nullptr,
                "tracking CPU allocator: the default CPU allocator returned a wrapped pointer");
    inner.release_context();
    return p;
  }

  c10::Allocator* inner_;
  c10::DeleterFnPtr inner_free_;
  const bool caching_;
  const size_t cache_limit_;
  mutable std::mutex mu_;
  std::unordered_map<void*, Block> sizes_;
  struct Cached {
    void* ptr;
    uint64_t age;  // order of caching: the key of its by_age_ entry
  };
  using FreeList = std::multimap<size_t, Cached>;
  void uncache(FreeList::iterator it) {  // mu_ held
    cached_ -= it->first;
    by_age_.erase(it->second.age);
    free_.erase(it);
  }
  FreeList free_;                                  // cached blocks by capacity
  std::map<uint64_t, FreeList::iterator> by_age_;  // the same blocks, least recently freed first
  uint64_t next_age_ = 0;
  size_t cached_ = 0;
  int64_t live_ = 0, peak_ = 0;
};

// COLLIDER_CPU_CACHING=0 turns caching off (glibc's behaviour); COLLIDER_CPU_CACHE_MIB bounds the
// bytes kept cached (beyond it the least recently freed blocks go back). Default: half the
// machine's memory. A fixed 8 GiB overflowed in a benchmark group of six points (mixtral-mini,
// B 4, T 1024, 2 cores, 24 GiB): regular's blocks, shared by three points, stayed recent, while
// Collider's and the floor's own shapes were given back every round and page-faulted in again,
// which added ~300 ms to exact_query's 4.0 s backward and nothing to regular's.
bool caching_from_env() {
  const char* v = std::getenv("COLLIDER_CPU_CACHING");
  return !(v && std::string(v) == "0");
}
size_t cache_limit_from_env() {
  const char* v = std::getenv("COLLIDER_CPU_CACHE_MIB");
  if (v) return static_cast<size_t>(std::max(0LL, std::atoll(v))) << 20;
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page <= 0) return size_t(8) << 30;
  return static_cast<size_t>(pages) * static_cast<size_t>(page) / 2;
}

std::once_flag g_install_once;

}  // namespace

void install_cpu_memory_tracking() {
  std::call_once(g_install_once, [] {
    // Never freed: tensors may outlive main's locals and free through it at exit.
    auto* alloc = new TrackingCpuAllocator(c10::GetDefaultCPUAllocator(), caching_from_env(), cache_limit_from_env());
    TrackingCpuAllocator::instance() = alloc;
    c10::SetCPUAllocator(alloc, /*priority=*/100);
  });
}

bool cpu_memory_tracking_installed() { return TrackingCpuAllocator::instance() != nullptr; }

int64_t cpu_cache_limit_bytes() {
  auto* a = TrackingCpuAllocator::instance();
  return a && a->caching() ? static_cast<int64_t>(a->cache_limit()) : 0;
}

const char* cpu_allocator_mode() {
  auto* a = TrackingCpuAllocator::instance();
  if (!a) return "system";
  return a->caching() ? "caching" : "tracking";
}

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
    auto stats =
        c10::getDeviceAllocator(c10::DeviceType::CUDA)->getDeviceStats(device.has_index() ? device.index() : 0);
    return stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak;
  }
  auto* a = TrackingCpuAllocator::instance();
  return a ? a->peak() : -1;
}

int64_t MemoryProbe::live_bytes() const {
  if (device.is_cuda()) {
    auto stats =
        c10::getDeviceAllocator(c10::DeviceType::CUDA)->getDeviceStats(device.has_index() ? device.index() : 0);
    return stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].current;
  }
  auto* a = TrackingCpuAllocator::instance();
  return a ? a->live() : -1;
}

const char* MemoryProbe::method() const {
  if (device.is_cuda()) return "cuda_caching_allocator_peak_allocated_bytes";
  return cpu_memory_tracking_installed() ? "cpu_tracking_allocator_peak_live_tensor_bytes" : "none";
}

}  // namespace collider::memory
