// What each fuzz target checks on one input, shared by the libFuzzer entry points (fuzz/fuzz_*.cpp,
// built by scripts/fuzz.sh) and by the regression test that replays every committed seed and every
// input a fuzzer once crashed on (tests/test_fuzz_regressions.cpp, ordinary build). A parser must
// either accept the input (and then behave: round trips, reads inside the data) or reject it with
// its own error type; a broken promise throws Violation, any other exception escapes (a crash for
// libFuzzer, a failure for the test), and memory errors are the sanitizers' to catch.
#pragma once

#include "harness/config/manifest.h"
#include "harness/components/token_data.h"
#include "harness/recipes/train_run.h"
#include "models/safetensors.h"

#include <collider/collider.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace collider::fuzz {

// A promise of the parser broken on an accepted input (not derived from std::exception, so that no
// handler for the parsers' own errors can swallow it).
struct Violation {
  std::string what;
};

inline void require(bool ok, const char* what) {
  if (!ok) throw Violation{what};
}

// The bytes as a file: a memfd, read through /proc/self/fd/N like a path on disk (and mmap-able).
class MemFile {
 public:
  MemFile(const uint8_t* data, size_t size) {
    fd_ = ::memfd_create("collider-fuzz", 0);
    size_t done = 0;
    while (fd_ >= 0 && done < size) {
      const ssize_t n = ::write(fd_, data + done, size - done);
      if (n <= 0) break;
      done += static_cast<size_t>(n);
    }
    ok_ = fd_ >= 0 && done == size;
  }
  ~MemFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  MemFile(const MemFile&) = delete;
  MemFile& operator=(const MemFile&) = delete;
  bool ok() const { return ok_; }
  std::string path() const { return "/proc/self/fd/" + std::to_string(fd_); }

 private:
  int fd_ = -1;
  bool ok_ = false;
};

// ---- safetensors: accepted files re-serialise to the same tensors ---------------------------------
inline void check_safetensors(const uint8_t* data, size_t size) {
  namespace cm = collider::models;
  std::map<std::string, torch::Tensor> tensors;
  std::map<std::string, std::string> metadata;
  try {
    auto file = cm::SafetensorsFile::from_buffer(data, size, "<fuzz>");
    tensors = file.tensors();
    metadata = file.metadata();
  } catch (const cm::SafetensorsError&) {
    return;  // rejected with our message: the expected outcome for most inputs
  }
  const std::string bytes = cm::serialize_safetensors(tensors, metadata);
  auto again = cm::SafetensorsFile::from_buffer(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "<re>");
  require(again.metadata() == metadata && again.entries().size() == tensors.size(), "safetensors: re-read differs");
  for (const auto& [name, t] : tensors) {
    torch::Tensor u = again.tensor(name);
    require(u.scalar_type() == t.scalar_type() && u.sizes() == t.sizes() && u.nbytes() == t.nbytes(),
            "safetensors: re-read tensor differs in dtype or shape");
    require(t.nbytes() == 0 || std::memcmp(u.data_ptr(), t.data_ptr(), t.nbytes()) == 0,
            "safetensors: re-read tensor differs in bytes");
  }
}

// ---- manifests: TOML, then "#--set" and one "--set key=value" per line -----------------------------
inline void check_manifest(const uint8_t* data, size_t size) {
  namespace ch = collider::harness;
  std::string text(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> sets;
  if (const auto cut = text.find("\n#--set\n"); cut != std::string::npos) {
    std::istringstream rest(text.substr(cut + 8));
    std::string line;
    while (std::getline(rest, line)) {
      if (line.rfind("--set ", 0) == 0) sets.push_back(line.substr(6));
    }
    text.resize(cut + 1);
  }
  try {
    const ch::Manifest m = ch::load_manifest_text(text, "<fuzz>", sets, /*check_device=*/false);
    require(!m.points.empty(), "manifest: accepted with no point to run");
    // The resolved manifest (what a run saves) loads again to the same points.
    const ch::Manifest again = ch::load_manifest_text(m.resolved_toml, "<resolved>", {}, false);
    require(again.points.size() == m.points.size(), "manifest: the resolved manifest has other points");
    for (size_t i = 0; i < m.points.size(); ++i) {
      require(again.points[i].id() == m.points[i].id(), "manifest: the resolved manifest has other points");
    }
  } catch (const ch::ManifestError&) {}
  if (text.find("[train]") != std::string::npos) {
    MemFile f(reinterpret_cast<const uint8_t*>(text.data()), text.size());
    if (!f.ok()) return;
    try {
      const ch::TrainManifest m = ch::load_train_manifest(f.path(), sets);
      require(!m.points.empty(), "training manifest: accepted with no run");
    } catch (const ch::ManifestError&) {}
  }
}

// ---- token shards and reference-loss files ----------------------------------------------------------
inline void check_tokens(const uint8_t* data, size_t size) {
  namespace ch = collider::harness;
  MemFile f(data, size);
  if (!f.ok()) return;
  std::shared_ptr<ch::TokenShard> shard;
  try {
    shard = std::make_shared<ch::TokenShard>(f.path());
  } catch (const std::runtime_error&) {}
  if (shard) {
    const int64_t n = shard->size();
    require(n >= 0, "token shard: accepted with a token count that does not fit int64");
    if (n > 0) {
      (void)shard->at(0);
      (void)shard->at(n - 1);
      const int64_t k = std::min<int64_t>(n, 4096);
      require(shard->slice(n - k, k).numel() == k, "token shard: slice has the wrong length");
    }
    if (n >= 5) {
      ch::WindowLoader loader(shard, 4, 1, /*seed=*/1);
      require(loader.batch(0).input_ids_BT.size(1) == 4, "token shard: window of the wrong length");
    }
  }
  std::unique_ptr<ch::RefLosses> ref;
  try {
    ref = std::make_unique<ch::RefLosses>(f.path());
  } catch (const std::runtime_error&) {}
  if (ref) {
    require(ref->num_windows() >= 0 && ref->seq_len() >= 1, "reference losses: accepted with no window length");
    if (ref->num_windows() > 0) (void)ref->rows({0, ref->num_windows() - 1});
  }
}

// ---- Plan::from_string: accepted plans print and re-read to the same text ---------------------------
inline void check_plan(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  collider::Plan plan;
  try {
    plan = collider::Plan::from_string(text);
  } catch (const collider::Error&) {
    return;  // rejected with our message
  }
  const std::string printed = plan.to_string();
  (void)plan.summary();
  (void)plan.num_token_nodes();
  collider::Plan again;
  try {
    again = collider::Plan::from_string(printed);
  } catch (const collider::Error&) { throw Violation{"plan: its own printed form is rejected"}; }
  require(again.to_string() == printed, "plan: printing the re-read plan gives other text");
}

}  // namespace collider::fuzz
