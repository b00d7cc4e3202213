// Timers for the training step: one interface, a steady-clock implementation (CPU) and a
// CUDA-event implementation (GPU; events on the current stream, resolved after a sync).
// A step records marks (mark() returns its index) and reads durations between marks once
// synchronize() has returned. mark() may be called from the autograd thread (backward markers).
// Tests: tests/test_train_step.cpp (CPU timer); the CUDA timer is exercised by `collider run`
// with run.device = "cuda".
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>

namespace collider::harness {

class Timer {
 public:
  virtual ~Timer() = default;
  // Records the current point on the device's timeline; returns its index since reset().
  virtual int64_t mark() = 0;
  // Blocks until every recorded mark is resolved (CUDA: waits for the last event).
  virtual void synchronize() = 0;
  // Milliseconds from mark a to mark b; valid after synchronize().
  virtual double elapsed_ms(int64_t a, int64_t b) const = 0;
  // Forgets every mark (start of a step).
  virtual void reset() = 0;
  virtual int64_t num_marks() const = 0;
  virtual const char* kind() const = 0;  // "steady_clock" | "cuda_event"
};

// Steady clock (host time). On CUDA devices use make_timer(), which returns the event timer.
std::unique_ptr<Timer> make_cpu_timer();
// CUDA events on the current stream of `device`; throws std::runtime_error when CUDA is not
// available. Compiles without CUDA headers (c10::Event, device-generic).
std::unique_ptr<Timer> make_cuda_timer(const torch::Device& device);
// The right timer for the device the step runs on.
std::unique_ptr<Timer> make_timer(const torch::Device& device);

// Host monotonic time in nanoseconds (trace timestamps, progress lines).
int64_t host_now_ns();

}  // namespace collider::harness
