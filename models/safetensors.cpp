// Safetensors reader/writer (see safetensors.h for the format). Validation order, each with its
// own message: length prefix, header length, JSON syntax, entry fields, dtype, shape vs byte size,
// overlap, out-of-range / truncated data, gaps, trailing bytes; BOOL bytes on copy-out.
// Tests: tests/test_safetensors.cpp; fuzzing: fuzz/fuzz_safetensors.cpp.
#include "models/safetensors.h"

#include "base/fsutil.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors stores little-endian data; this reader copies bytes as they are and needs a little-endian host"
#endif

namespace collider::models {

namespace {

using nlohmann::json;

struct DtypeInfo {
  const char* name;
  torch::ScalarType type;
  uint64_t bytes;
};

const std::vector<DtypeInfo>& dtype_table() {
  static const std::vector<DtypeInfo> table = {
      {"F64", torch::kFloat64, 8},
      {"F32", torch::kFloat32, 4},
      {"F16", torch::kFloat16, 2},
      {"BF16", torch::kBFloat16, 2},
      {"F8_E4M3", torch::kFloat8_e4m3fn, 1},
      {"F8_E5M2", torch::kFloat8_e5m2, 1},
      {"I64", torch::kInt64, 8},
      {"I32", torch::kInt32, 4},
      {"I16", torch::kInt16, 2},
      {"I8", torch::kInt8, 1},
      {"U64", torch::kUInt64, 8},
      {"U32", torch::kUInt32, 4},
      {"U16", torch::kUInt16, 2},
      {"U8", torch::kUInt8, 1},
      {"BOOL", torch::kBool, 1},
  };
  return table;
}

const DtypeInfo* find_dtype(const std::string& name) {
  for (const auto& d : dtype_table())
    if (name == d.name) return &d;
  return nullptr;
}

std::string known_dtypes() {
  std::string s;
  for (const auto& d : dtype_table()) s += (s.empty() ? "" : ", ") + std::string(d.name);
  return s;
}

[[noreturn]] void fail(const std::string& source, const std::string& what) {
  throw SafetensorsError(fmt::format("safetensors file '{}': {}", source, what));
}

// JSON nesting deeper than this cannot be a valid header (entries are at depth 2, shapes at 3).
constexpr int kMaxJsonDepth = 8;

}  // namespace

namespace detail {

std::string shape_str(torch::IntArrayRef shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

std::string join_names(const std::vector<std::string>& names, size_t max_names) {
  std::vector<std::string> shown(names.begin(), names.begin() + std::min(names.size(), max_names));
  std::string s = fmt::format("{}", fmt::join(shown, ", "));
  if (names.size() > max_names) s += fmt::format(", ... ({} more)", names.size() - max_names);
  return s;
}

}  // namespace detail

using detail::shape_str;

struct SafetensorsFile::Mapping {
  void* addr = nullptr;
  size_t length = 0;
  ~Mapping() {
    if (addr) munmap(addr, length);
  }
};

SafetensorsFile::SafetensorsFile(SafetensorsFile&&) noexcept = default;
SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&&) noexcept = default;
SafetensorsFile::~SafetensorsFile() = default;

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  SafetensorsFile f;
  f.source_ = path;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw SafetensorsError(fmt::format("safetensors file '{}': cannot open: {}", path, std::strerror(errno)));
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path, "is not a regular file");
  }
  f.size_ = static_cast<size_t>(st.st_size);
  if (f.size_ > 0) {
    void* addr = mmap(nullptr, f.size_, PROT_READ, MAP_PRIVATE, fd, 0);
    int err = errno;
    ::close(fd);
    if (addr == MAP_FAILED) fail(path, fmt::format("cannot map {} bytes: {}", f.size_, std::strerror(err)));
    f.mapping_ = std::make_unique<Mapping>();
    f.mapping_->addr = addr;
    f.mapping_->length = f.size_;
    f.data_ = static_cast<const uint8_t*>(addr);
  } else {
    ::close(fd);
  }
  f.parse();
  return f;
}

SafetensorsFile SafetensorsFile::from_buffer(const uint8_t* data, size_t size, const std::string& source) {
  SafetensorsFile f;
  f.source_ = source;
  f.data_ = data;
  f.size_ = data ? size : 0;
  f.parse();
  return f;
}

void SafetensorsFile::parse() {
  const std::string& src = source_;
  if (size_ < 8)
    fail(src, fmt::format("file is truncated: {} bytes, shorter than the 8-byte header-length prefix", size_));
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | data_[i];
  if (header_len > kSafetensorsMaxHeaderBytes)
    fail(src, fmt::format("header length {} bytes is larger than the {}-byte limit (corrupt length prefix?)",
                          header_len, kSafetensorsMaxHeaderBytes));
  if (header_len > size_ - 8)
    fail(src, fmt::format("header length {} bytes exceeds the {} bytes that follow the length prefix "
                          "(the file was cut short or the prefix is corrupt)",
                          header_len, size_ - 8));
  data_begin_ = 8 + header_len;
  const uint64_t data_size = size_ - data_begin_;

  // Parse, rejecting duplicate top-level keys (nlohmann keeps the last silently) and deep nesting.
  std::set<std::string> seen;
  json::parser_callback_t cb = [&](int depth, json::parse_event_t event, json& parsed) {
    if ((event == json::parse_event_t::object_start || event == json::parse_event_t::array_start) &&
        depth >= kMaxJsonDepth)
      fail(src,
           fmt::format("header is not a valid safetensors header: JSON nested deeper than {} levels", kMaxJsonDepth));
    if (event == json::parse_event_t::key && depth == 1) {
      const std::string& key = parsed.get_ref<const std::string&>();
      if (!seen.insert(key).second) fail(src, fmt::format("duplicate tensor name '{}' in the header", key));
    }
    return true;
  };
  json header;
  try {
    const char* begin = reinterpret_cast<const char*>(data_ + 8);
    header = json::parse(begin, begin + header_len, cb);
  } catch (const json::exception& e) { fail(src, fmt::format("header is not valid JSON ({})", e.what())); }
  if (!header.is_object()) fail(src, "header is not valid JSON for safetensors: expected an object at the top level");

  entries_.clear();
  index_.clear();
  metadata_.clear();
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) fail(src, "__metadata__ must be an object of string values");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) fail(src, fmt::format("__metadata__ value of '{}' is not a string", m.key()));
        metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (!v.is_object()) fail(src, fmt::format("entry '{}' is not an object with dtype, shape, data_offsets", name));
    auto dt = v.find("dtype");
    auto sh = v.find("shape");
    auto off = v.find("data_offsets");
    if (dt == v.end() || sh == v.end() || off == v.end())
      fail(src, fmt::format("entry '{}' lacks one of the fields dtype, shape, data_offsets", name));
    if (!dt->is_string()) fail(src, fmt::format("tensor '{}' has a dtype that is not a string", name));
    SafetensorsEntry e;
    e.name = name;
    e.dtype = dt->get<std::string>();
    const DtypeInfo* info = find_dtype(e.dtype);
    if (!info) fail(src, fmt::format("tensor '{}' has unknown dtype '{}' (known: {})", name, e.dtype, known_dtypes()));
    if (!sh->is_array()) fail(src, fmt::format("tensor '{}' has an invalid shape: not an array", name));
    for (const json& d : *sh) {
      if (!d.is_number_unsigned() && !(d.is_number_integer() && d.get<int64_t>() >= 0))
        fail(src, fmt::format("tensor '{}' has an invalid shape {}: dimensions must be non-negative integers", name,
                              sh->dump()));
      uint64_t u = d.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        fail(src, fmt::format("tensor '{}' has an invalid shape {}: dimension too large", name, sh->dump()));
      e.shape.push_back(static_cast<int64_t>(u));
    }
    if (!off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() || !(*off)[1].is_number_unsigned())
      fail(src, fmt::format("tensor '{}' has invalid data_offsets {}: expected [begin, end] as non-negative integers",
                            name, off->dump()));
    e.begin = (*off)[0].get<uint64_t>();
    e.end = (*off)[1].get<uint64_t>();
    if (e.begin > e.end) fail(src, fmt::format("tensor '{}' has reversed data_offsets [{}, {})", name, e.begin, e.end));
    // Byte size implied by shape and dtype, with overflow checks. Dimensions of 0 give 0 bytes,
    // but the product of the non-zero dimensions must still fit (torch computes strides from it).
    uint64_t numel_nonzero = 1;
    bool has_zero = false;
    for (int64_t d : e.shape) {
      if (d == 0) {
        has_zero = true;
        continue;
      }
      if (__builtin_mul_overflow(numel_nonzero, static_cast<uint64_t>(d), &numel_nonzero) ||
          numel_nonzero > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) / 8)
        fail(src, fmt::format("tensor '{}' has shape {} whose element count overflows", name, shape_str(e.shape)));
    }
    const uint64_t nbytes = has_zero ? 0 : numel_nonzero * info->bytes;
    if (nbytes != e.end - e.begin)
      fail(src, fmt::format("size mismatch: tensor '{}' with shape {} and dtype {} needs {} bytes but its "
                            "data_offsets [{}, {}) span {}",
                            name, shape_str(e.shape), e.dtype, nbytes, e.begin, e.end, e.end - e.begin));
    entries_.push_back(std::move(e));
  }

  std::sort(entries_.begin(), entries_.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  // Overlap: in begin order, a tensor may not start before the previous one ends.
  for (size_t i = 1; i < entries_.size(); ++i) {
    const auto& a = entries_[i - 1];
    const auto& b = entries_[i];
    if (b.begin < a.end)
      fail(src, fmt::format("tensors '{}' [{}, {}) and '{}' [{}, {}) overlap in the data region", a.name, a.begin,
                            a.end, b.name, b.begin, b.end));
  }
  // Out of range. When the entries tile [0, max_end) with no hole, the header is consistent and
  // the data region is simply short: the file was truncated.
  uint64_t max_end = 0;
  bool contiguous = true;
  for (size_t i = 0; i < entries_.size(); ++i) {
    const auto& e = entries_[i];
    if (e.begin != (i == 0 ? 0 : entries_[i - 1].end)) contiguous = false;
    max_end = std::max(max_end, e.end);
  }
  if (max_end > data_size) {
    if (contiguous)
      fail(src, fmt::format("file is truncated: the header describes {} data bytes but only {} are present", max_end,
                            data_size));
    for (const auto& e : entries_)
      if (e.end > data_size)
        fail(src, fmt::format("data_offsets [{}, {}) of tensor '{}' point outside the data region of {} bytes", e.begin,
                              e.end, e.name, data_size));
  }
  // The format forbids holes and trailing bytes (no polyglot files).
  uint64_t pos = 0;
  for (const auto& e : entries_) {
    if (e.begin > pos)
      fail(src, fmt::format("gap in the data region: bytes [{}, {}) before tensor '{}' belong to no tensor", pos,
                            e.begin, e.name));
    pos = std::max(pos, e.end);
  }
  if (pos != data_size)
    fail(src, fmt::format("{} trailing bytes after the last tensor belong to no tensor", data_size - pos));
  for (size_t i = 0; i < entries_.size(); ++i) index_[entries_[i].name] = i;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(index_.size());
  for (const auto& kv : index_) out.push_back(kv.first);
  return out;
}

const SafetensorsEntry& SafetensorsFile::entry(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) fail(source_, fmt::format("has no tensor named '{}'", name));
  return entries_[it->second];
}

torch::Tensor SafetensorsFile::tensor(const std::string& name) const {
  const SafetensorsEntry& e = entry(name);
  const DtypeInfo* info = find_dtype(e.dtype);  // validated in parse()
  torch::Tensor t = torch::empty(e.shape, torch::TensorOptions().dtype(info->type).device(torch::kCPU));
  const uint64_t nbytes = e.end - e.begin;
  TORCH_CHECK(static_cast<uint64_t>(t.nbytes()) == nbytes, "internal: safetensors size check disagrees with torch");
  const uint8_t* src = data_ + data_begin_ + e.begin;
  if (info->type == torch::kBool) {
    for (uint64_t i = 0; i < nbytes; ++i)
      if (src[i] > 1)
        fail(source_, fmt::format("BOOL tensor '{}' holds byte value {} at element {} (only 0 and 1 are valid)", name,
                                  static_cast<int>(src[i]), i));
  }
  if (nbytes > 0) std::memcpy(t.data_ptr(), src, nbytes);
  return t;
}

std::map<std::string, torch::Tensor> SafetensorsFile::tensors() const {
  std::map<std::string, torch::Tensor> out;
  for (const auto& e : entries_) out.emplace(e.name, tensor(e.name));
  return out;
}

std::string safetensors_dtype_name(torch::ScalarType t) {
  for (const auto& d : dtype_table())
    if (d.type == t) return d.name;
  throw SafetensorsError(
      fmt::format("dtype {} cannot be stored in safetensors (supported: {})", c10::toString(t), known_dtypes()));
}

torch::ScalarType safetensors_dtype(const std::string& name, const std::string& source) {
  const DtypeInfo* info = find_dtype(name);
  if (!info) fail(source, fmt::format("unknown dtype '{}' (known: {})", name, known_dtypes()));
  return info->type;
}

std::string serialize_safetensors(const std::map<std::string, torch::Tensor>& tensors,
                                  const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<torch::Tensor> cpu;
  cpu.reserve(tensors.size());
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    if (name == "__metadata__") throw SafetensorsError("cannot save a tensor named '__metadata__' (reserved key)");
    if (!t.defined()) throw SafetensorsError(fmt::format("cannot save tensor '{}': it is undefined", name));
    if (t.layout() != torch::kStrided)
      throw SafetensorsError(fmt::format("cannot save tensor '{}': safetensors holds dense tensors only", name));
    torch::Tensor c = t.detach().to(torch::kCPU).resolve_conj().resolve_neg().contiguous();
    const uint64_t nbytes = static_cast<uint64_t>(c.nbytes());
    header[name] = {{"dtype", safetensors_dtype_name(c.scalar_type())},
                    {"shape", c.sizes().vec()},
                    {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
    cpu.push_back(std::move(c));
  }
  std::string hdr = header.dump();
  hdr.append((8 - hdr.size() % 8) % 8, ' ');
  std::string out;
  out.reserve(8 + hdr.size() + offset);
  uint64_t n = hdr.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  out += hdr;
  for (const auto& c : cpu)
    if (c.nbytes() > 0) out.append(static_cast<const char*>(c.data_ptr()), c.nbytes());
  return out;
}

void save_safetensors(const std::string& path, const std::map<std::string, torch::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  fsutil::write_file_atomic(path, serialize_safetensors(tensors, metadata));  // fsync, rename, errno in errors
}

std::map<std::string, torch::Tensor> load_safetensors(const std::string& path) {
  return SafetensorsFile::open(path).tensors();
}

}  // namespace collider::models
