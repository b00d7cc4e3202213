// Probes the measurement engine runs beside a point's steps, untimed by them.
// cold_copy_ms: what a plain copy of `bytes` costs on this machine with both sides out of cache,
// the floor of any rewrite that copies the kept rows (it must write that much and read at least as
// much). Timed right after the steps it is compared with (memory bandwidth on a shared host
// drifts; the medians then cover the same minutes); a 64 MiB fill before the copy evicts both
// buffers from the caches, and the buffers live only inside the call, so the next step's peak
// memory does not see them. Device-synchronised on CUDA. 0 for bytes <= 0.
// Used by the engine's groups (run.copy_probe).
#pragma once

#include <torch/torch.h>

#include <cstdint>

namespace collider::harness {

double cold_copy_ms(int64_t bytes, const torch::Device& device);

}  // namespace collider::harness
