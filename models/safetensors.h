// Our own small safetensors reader/writer (the Hugging Face weight format; no external library).
// File layout: 8-byte little-endian header length N, N bytes of JSON
//   {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"key": "value"}}
// then the data region; offsets are relative to its start and must tile it exactly.
// Every malformed input is rejected with a SafetensorsError naming the file and the problem; the
// reader never trusts a length or offset before checking it (fuzzed by fuzz/fuzz_safetensors.cpp).
// Tests: tests/test_safetensors.cpp (OMP_NUM_THREADS=1 build/tests/test_safetensors).
#pragma once

#include <torch/torch.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace collider::models {

// Every rejection of a safetensors file or of a checkpoint's tensor set. what() starts with the
// file (or "<memory>") and says what is wrong.
class SafetensorsError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Headers larger than this are rejected before any allocation (the reference implementation's limit).
constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

// One tensor's entry in the header. begin/end are byte offsets into the data region.
struct SafetensorsEntry {
  std::string name;
  std::string dtype;           // "F32", "BF16", ... as written in the file
  std::vector<int64_t> shape;  // [] for a scalar
  uint64_t begin = 0;
  uint64_t end = 0;
};

// Parsed and validated view of a safetensors file held in memory or mapped from disk.
// Copying tensors out (tensor()) never aliases the file's bytes.
class SafetensorsFile {
 public:
  // Maps `path` read-only (mmap) and validates the header and the layout.
  static SafetensorsFile open(const std::string& path);
  // Validates bytes held by the caller; the bytes must outlive the object. `source` names them in errors.
  static SafetensorsFile from_buffer(const uint8_t* data, size_t size, const std::string& source = "<memory>");

  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  ~SafetensorsFile();

  const std::string& source() const { return source_; }
  // Entries in data-offset order.
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  std::vector<std::string> names() const;  // sorted
  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  const SafetensorsEntry& entry(const std::string& name) const;  // throws naming the tensor
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // A new CPU tensor holding a copy of the named tensor's bytes (bit-exact; BOOL bytes must be 0/1).
  torch::Tensor tensor(const std::string& name) const;
  // Every tensor, by name.
  std::map<std::string, torch::Tensor> tensors() const;

 private:
  SafetensorsFile() = default;
  void parse();
  struct Mapping;  // RAII mmap
  std::unique_ptr<Mapping> mapping_;
  const uint8_t* data_ = nullptr;  // whole file
  size_t size_ = 0;
  uint64_t data_begin_ = 0;  // 8 + header length
  std::string source_;
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, size_t> index_;  // name -> position in entries_
  std::map<std::string, std::string> metadata_;
};

// The safetensors name of a torch dtype ("F32", ...); throws for dtypes the format cannot hold.
std::string safetensors_dtype_name(torch::ScalarType t);
// The torch dtype of a safetensors dtype name; throws SafetensorsError("unknown dtype ...").
torch::ScalarType safetensors_dtype(const std::string& name, const std::string& source);

// Serialises tensors (any device; written from a contiguous CPU copy) into safetensors bytes:
// entries sorted by name, header padded with spaces to a multiple of 8 bytes.
std::string serialize_safetensors(const std::map<std::string, torch::Tensor>& tensors,
                                  const std::map<std::string, std::string>& metadata = {});
// Writes serialize_safetensors() to `path` through a temporary file and a rename, so that a crash
// never leaves a half-written checkpoint under the final name (base/fsutil.h's write_file_atomic;
// fsutil::WriteError naming the path and errno on failure).
void save_safetensors(const std::string& path, const std::map<std::string, torch::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {});
// Convenience: open(path).tensors().
std::map<std::string, torch::Tensor> load_safetensors(const std::string& path);

namespace detail {
// "[2, 3]": a shape in error messages.
std::string shape_str(torch::IntArrayRef shape);
// "a, b, c" (at most `max_names`, then "... (N more)"): a set of tensor names in error messages.
std::string join_names(const std::vector<std::string>& names, size_t max_names = 20);
}  // namespace detail

}  // namespace collider::models
