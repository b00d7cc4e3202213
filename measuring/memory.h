// Peak memory of a measured step, for the suite's measurements (the measurement engine, the
// benchmarks and the Python package's benchmark helpers; not part of the public API). CUDA: the caching allocator's statistics (peak allocated bytes,
// what torch.cuda.max_memory_allocated reports). CPU: a tracking CPU allocator installed in
// front of c10's default one that counts live tensor bytes and their peak (the same quantity:
// bytes held by tensors, not allocator or process overhead). Each row names its method in
// `peak_mem_method`.
// Tests: tests/test_sweep.cpp (CPU peak grows with the batch; the cache past its limit).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>

namespace collider::memory {

// Installs the tracking CPU allocator (idempotent; tensors allocated before keep their deleter).
// It also caches freed blocks of >= 64 KiB for reuse, like CUDA's caching allocator, so that a
// step does not page-fault fresh memory in for every large tensor (on 2 cores that costs ~5 ms
// per 20 MB); COLLIDER_CPU_CACHING=0 turns the caching off, COLLIDER_CPU_CACHE_MIB bounds it
// (default: half the machine's memory).
void install_cpu_memory_tracking();
bool cpu_memory_tracking_installed();
// "caching", "tracking" (caching off) or "system" (not installed): recorded in env.json.
const char* cpu_allocator_mode();
// The bytes the cache may hold (0 when it is not installed or caching is off): env.json.
int64_t cpu_cache_limit_bytes();

struct MemoryProbe {
  explicit MemoryProbe(const torch::Device& device);
  void reset_peak();           // peak := bytes live now
  int64_t peak_bytes() const;  // peak since reset_peak()
  int64_t live_bytes() const;
  const char* method() const;  // value of the row's peak_mem_method
  torch::Device device;
};

}  // namespace collider::memory
