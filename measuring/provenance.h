// What a measurement ran on: the commit, torch and CUDA versions, the device's name, the intra-op
// threads and the host. Every timing row carries it (DESIGN.md section 6); the harness writes it
// (harness/run/results.h: to_json, the rows' keys) and the Python benchmark takes the same record
// through collider._measure.provenance, so both collect it one way. Like memory.h, a
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

// The record's keys and values, in the rows' order: f(key, value) for each field, where value is a
// std::string, a bool, an int64_t or, for cuda_version, a const std::string* (null: no CUDA). The
// harness's rows and the Python binding both write it through this, so the keys are named once.
template <class F>
void for_each_field(const Provenance& p, F&& f) {
  f("git_sha", p.git_sha);
  f("git_dirty", p.git_dirty);
  f("torch_version", p.torch_version);
  f("cuda_version", p.cuda_version.empty() ? nullptr : &p.cuda_version);
  f("device_name", p.device_name);
  f("num_threads", p.num_threads);
  f("hostname", p.hostname);
}

}  // namespace collider
