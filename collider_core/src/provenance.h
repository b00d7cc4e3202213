// What a measurement ran on: the commit, torch and CUDA versions, the device's name, the intra-op
// threads and the host. Every timing row carries it (DESIGN.md section 6); the harness writes it
// (harness/run/results.h: to_json, the rows' keys) and the Python benchmark takes the same record
// through the bindings (collider._C._provenance), so both collect it one way. Like memory.h, a
// helper for measuring, not part of the filtering API. Tests: tests/test_results.cpp.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>

namespace collider {

struct Provenance {
  std::string git_sha;  // "unknown" outside a git checkout
  bool git_dirty = false;
  std::string torch_version;
  std::string cuda_version;  // CUDA runtime torch was built with; empty when CUDA is not available
  std::string device_name;   // GPU name, or the CPU model
  int64_t num_threads = 0;
  std::string hostname;
};

// source_dir: the checkout whose commit the numbers come from (git rev-parse there).
Provenance collect_provenance(const torch::Device& device, const std::string& source_dir);

}  // namespace collider
