// Token data (token_data.h): SentencePiece wrapper, mmap'd shards, seeded windows, reference losses.
#include "harness/components/token_data.h"

#include "base/fsutil.h"

#include <fmt/format.h>

#ifdef COLLIDER_HAVE_SENTENCEPIECE
#include <sentencepiece_processor.h>
#endif

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <ostream>
#include <random>
#include <stdexcept>

namespace sentencepiece {
#ifndef COLLIDER_HAVE_SENTENCEPIECE
class SentencePieceProcessor {};  // complete type for unique_ptr in builds without the library
#endif
}  // namespace sentencepiece

namespace collider::harness {

namespace {

constexpr char kShardMagic[8] = {'C', 'L', 'D', 'R', 'T', 'O', 'K', '1'};
constexpr char kRefMagic[8] = {'C', 'L', 'D', 'R', 'R', 'E', 'F', '1'};
constexpr size_t kRefHeaderBytes = 32;

// Maps a whole file read-only; returns base and size. Throws naming the file.
const uint8_t* map_file(const std::string& path, size_t* bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw std::runtime_error(
        fmt::format("cannot open '{}': {} (run ./scripts/prepare_data.sh?)", path, std::strerror(errno)));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_size < 0) {
    ::close(fd);
    throw std::runtime_error(fmt::format("cannot stat '{}': {}", path, std::strerror(errno)));
  }
  *bytes = static_cast<size_t>(st.st_size);
  if (*bytes == 0) {
    ::close(fd);
    throw std::runtime_error(fmt::format("'{}' is empty", path));
  }
  void* p = ::mmap(nullptr, *bytes, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) throw std::runtime_error(fmt::format("cannot mmap '{}': {}", path, std::strerror(errno)));
  return static_cast<const uint8_t*>(p);
}

// Releases a mapping made by map_file (no-op when already released) and forgets it.
void unmap_file(const uint8_t*& base, size_t bytes) {
  if (base) ::munmap(const_cast<uint8_t*>(base), bytes);
  base = nullptr;
}

template <typename T>
T read_le(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));  // x86 / ARM little endian, as written by numpy '<'
  return v;
}

// Header + payload through fsutil's atomic writer (temporary name, fsync, rename): two processes
// writing the same shard or reference losses never interleave, and a reader never sees half a file.
void write_atomically(const std::string& path, const std::vector<uint8_t>& header, const void* payload,
                      size_t payload_bytes) {
  fsutil::write_file_atomic(path, {std::string_view(reinterpret_cast<const char*>(header.data()), header.size()),
                                   std::string_view(static_cast<const char*>(payload), payload_bytes)});
}

template <typename T>
void put(std::vector<uint8_t>& h, T v) {
  const auto* p = reinterpret_cast<const uint8_t*>(&v);
  h.insert(h.end(), p, p + sizeof(T));
}

torch::Device model_device(models::CausalLM& model) {
  auto params = model->parameters();
  return params.empty() ? torch::Device(torch::kCPU) : params.front().device();
}

}  // namespace

// ---- Tokenizer ---------------------------------------------------------------------------------

bool Tokenizer::available() {
#ifdef COLLIDER_HAVE_SENTENCEPIECE
  return true;
#else
  return false;
#endif
}

#ifdef COLLIDER_HAVE_SENTENCEPIECE
Tokenizer::Tokenizer(const std::string& model_path)
    : sp_(std::make_unique<sentencepiece::SentencePieceProcessor>()), path_(model_path) {
  const auto status = sp_->Load(model_path);
  if (!status.ok()) {
    throw std::runtime_error(fmt::format("cannot load SentencePiece model '{}': {}", model_path, status.ToString()));
  }
}
std::vector<int32_t> Tokenizer::encode(const std::string& text) const {
  std::vector<int> ids;
  const auto st = sp_->Encode(text, &ids);
  if (!st.ok()) throw std::runtime_error(fmt::format("SentencePiece encode failed ({}): {}", path_, st.ToString()));
  return {ids.begin(), ids.end()};
}
std::string Tokenizer::decode(const std::vector<int32_t>& ids) const {
  const int64_t V = vocab_size();
  for (int32_t id : ids) {
    if (id < 0 || id >= V) {
      throw std::invalid_argument(fmt::format("Tokenizer::decode: id {} outside [0, {}) of '{}'", id, V, path_));
    }
  }
  std::string text;
  const auto st = sp_->Decode(std::vector<int>(ids.begin(), ids.end()), &text);
  if (!st.ok()) throw std::runtime_error(fmt::format("SentencePiece decode failed ({}): {}", path_, st.ToString()));
  return text;
}
int64_t Tokenizer::vocab_size() const { return sp_->GetPieceSize(); }
int32_t Tokenizer::bos_id() const { return sp_->bos_id(); }
int32_t Tokenizer::eos_id() const { return sp_->eos_id(); }
std::string Tokenizer::piece(int32_t id) const { return sp_->IdToPiece(id); }
#else
Tokenizer::Tokenizer(const std::string& model_path) : path_(model_path) {
  throw std::runtime_error(
      fmt::format("cannot load '{}': this build has no SentencePiece (install libsentencepiece-dev, e.g. via "
                  "./scripts/bootstrap.sh, and re-run cmake)",
                  model_path));
}
std::vector<int32_t> Tokenizer::encode(const std::string&) const { return {}; }
std::string Tokenizer::decode(const std::vector<int32_t>&) const { return {}; }
int64_t Tokenizer::vocab_size() const { return 0; }
int32_t Tokenizer::bos_id() const { return -1; }
int32_t Tokenizer::eos_id() const { return -1; }
std::string Tokenizer::piece(int32_t) const { return {}; }
#endif
Tokenizer::~Tokenizer() = default;

// ---- shards ------------------------------------------------------------------------------------

void write_token_shard(const std::string& path, const std::vector<int64_t>& ids, uint32_t vocab_size, uint32_t eos_id) {
  const uint32_t token_bytes = vocab_size <= 65536 ? 2 : 4;
  std::vector<uint8_t> h(kShardMagic, kShardMagic + 8);
  put<uint32_t>(h, 1);
  put<uint32_t>(h, token_bytes);
  put<uint64_t>(h, ids.size());
  put<uint32_t>(h, vocab_size);
  put<uint32_t>(h, eos_id);
  std::vector<uint8_t> payload(ids.size() * token_bytes);
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= static_cast<int64_t>(vocab_size)) {
      throw std::invalid_argument(fmt::format("write_token_shard: id {} at {} outside [0, {})", ids[i], i, vocab_size));
    }
    if (token_bytes == 2) {
      const auto v = static_cast<uint16_t>(ids[i]);
      std::memcpy(&payload[i * 2], &v, 2);
    } else {
      const auto v = static_cast<uint32_t>(ids[i]);
      std::memcpy(&payload[i * 4], &v, 4);
    }
  }
  write_atomically(path, h, payload.data(), payload.size());
}

TokenShard::TokenShard(const std::string& path) : path_(path) {
  base_ = map_file(path, &map_bytes_);
  auto fail = [&](const std::string& what) {
    unmap_file(base_, map_bytes_);
    throw std::runtime_error(
        fmt::format("token shard '{}': {} (re-create it with ./scripts/prepare_data.sh)", path, what));
  };
  if (map_bytes_ < kShardHeaderBytes || std::memcmp(base_, kShardMagic, 8) != 0) fail("not a CLDRTOK1 shard");
  header_.version = read_le<uint32_t>(base_ + 8);
  header_.token_bytes = read_le<uint32_t>(base_ + 12);
  header_.num_tokens = read_le<uint64_t>(base_ + 16);
  header_.vocab_size = read_le<uint32_t>(base_ + 24);
  header_.eos_id = read_le<uint32_t>(base_ + 28);
  if (header_.version != 1) fail(fmt::format("version {} (this build reads 1)", header_.version));
  if (header_.token_bytes != 2 && header_.token_bytes != 4)
    fail(fmt::format("{} bytes per token", header_.token_bytes));
  // Compared by division: a corrupt token count must not overflow the product (found by
  // fuzz/fuzz_tokens.cpp; tests/fuzz_regressions/tokens/).
  const uint64_t payload = map_bytes_ - kShardHeaderBytes;
  if (payload % header_.token_bytes != 0 || payload / header_.token_bytes != header_.num_tokens) {
    fail(fmt::format("{} bytes on disk but the header says {} tokens of {} bytes", map_bytes_, header_.num_tokens,
                     header_.token_bytes));
  }
}

TokenShard::~TokenShard() { unmap_file(base_, map_bytes_); }

int64_t TokenShard::at(int64_t i) const {
  TORCH_CHECK(i >= 0 && i < size(), "TokenShard::at: index ", i, " outside [0, ", size(), ") of ", path_);
  const uint8_t* p = base_ + kShardHeaderBytes + static_cast<size_t>(i) * header_.token_bytes;
  return header_.token_bytes == 2 ? read_le<uint16_t>(p) : read_le<uint32_t>(p);
}

torch::Tensor TokenShard::slice(int64_t begin, int64_t n) const {
  TORCH_CHECK(begin >= 0 && n >= 0 && begin + n <= size(), "TokenShard::slice: [", begin, ", ", begin + n,
              ") outside the ", size(), " tokens of ", path_);
  auto out = torch::empty({n}, torch::kLong);
  auto* o = out.data_ptr<int64_t>();
  const uint8_t* p = base_ + kShardHeaderBytes + static_cast<size_t>(begin) * header_.token_bytes;
  if (header_.token_bytes == 2) {
    for (int64_t i = 0; i < n; ++i) o[i] = read_le<uint16_t>(p + 2 * i);
  } else {
    for (int64_t i = 0; i < n; ++i) o[i] = read_le<uint32_t>(p + 4 * i);
  }
  return out;
}

// ---- windows -----------------------------------------------------------------------------------

std::vector<int64_t> seeded_permutation(int64_t n, uint64_t seed, int64_t epoch) {
  std::vector<int64_t> p(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) p[static_cast<size_t>(i)] = i;
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ULL + static_cast<uint64_t>(epoch) + 1);
  for (int64_t i = n - 1; i > 0; --i) {
    const auto j = static_cast<int64_t>(rng() % static_cast<uint64_t>(i + 1));
    std::swap(p[static_cast<size_t>(i)], p[static_cast<size_t>(j)]);
  }
  return p;
}

WindowLoader::WindowLoader(std::shared_ptr<const TokenShard> shard, int64_t seq_len, int64_t batch_size, uint64_t seed,
                           int64_t pool, int64_t rank, int64_t world_size)
    : shard_(std::move(shard)), T_(seq_len), B_(batch_size), seed_(seed), rank_(rank), world_size_(world_size) {
  if (T_ < 1 || B_ < 1) {
    throw std::invalid_argument(fmt::format("WindowLoader: seq_len {} and batch_size {} must be >= 1", T_, B_));
  }
  if (world_size_ < 1 || rank_ < 0 || rank_ >= world_size_) {
    throw std::invalid_argument(fmt::format("WindowLoader: rank {} outside [0, world_size {})", rank_, world_size_));
  }
  const int64_t all = (shard_->size() - 1) / T_;
  if (pool < 0 || pool > all) {
    throw std::invalid_argument(fmt::format("WindowLoader: pool {} outside [0, {}] (windows of T = {} in '{}')", pool,
                                            all, T_, shard_->path()));
  }
  num_windows_ = pool > 0 ? pool : all;
  if (num_windows_ < B_ * world_size_) {
    throw std::invalid_argument(
        fmt::format("WindowLoader: '{}' has {} windows of T = {}, fewer than one global batch "
                    "({} x {} ranks); use a smaller batch or more data",
                    shard_->path(), num_windows_, T_, B_, world_size_));
  }
}

const std::vector<int64_t>& WindowLoader::permutation(int64_t epoch) const {
  if (epoch != cached_epoch_) {
    perm_ = seeded_permutation(num_windows_, seed_, epoch);
    cached_epoch_ = epoch;
  }
  return perm_;
}

std::vector<int64_t> WindowLoader::window_ids(int64_t step) const {
  TORCH_CHECK(step >= 0, "WindowLoader: step must be >= 0, got ", step);
  // Batches never straddle epochs: each epoch holds floor(W / (B*R)) whole global batches.
  const int64_t global = B_ * world_size_;
  const int64_t per_epoch = num_windows_ / global;
  const int64_t epoch = step / per_epoch, in_epoch = step % per_epoch;
  const auto& p = permutation(epoch);
  std::vector<int64_t> ids(static_cast<size_t>(B_));
  for (int64_t b = 0; b < B_; ++b)
    ids[static_cast<size_t>(b)] = p[static_cast<size_t>(in_epoch * global + rank_ * B_ + b)];
  return ids;
}

Batch WindowLoader::batch_of(const std::vector<int64_t>& windows) const {
  const auto B = static_cast<int64_t>(windows.size());
  auto ids = torch::empty({B, T_ + 1}, torch::kLong);
  for (int64_t b = 0; b < B; ++b) ids[b].copy_(shard_->slice(windows[static_cast<size_t>(b)] * T_, T_ + 1));
  Batch batch;
  batch.input_ids_BT = ids.narrow(1, 0, T_).contiguous();
  batch.labels_BT = ids.narrow(1, 1, T_).contiguous();
  return batch;
}

// ---- reference losses --------------------------------------------------------------------------

RefLosses::RefLosses(const std::string& path) : path_(path) {
  base_ = map_file(path, &map_bytes_);
  auto fail = [&](const std::string& what) {
    unmap_file(base_, map_bytes_);
    throw std::runtime_error(fmt::format("reference-loss file '{}': {} (delete it to recompute)", path, what));
  };
  if (map_bytes_ < kRefHeaderBytes || std::memcmp(base_, kRefMagic, 8) != 0) fail("not a CLDRREF1 file");
  if (read_le<uint32_t>(base_ + 8) != 1) fail("unknown version");
  T_ = read_le<uint32_t>(base_ + 12);
  W_ = static_cast<int64_t>(read_le<uint64_t>(base_ + 16));
  shard_tokens_ = static_cast<int64_t>(read_le<uint64_t>(base_ + 24));
  if (T_ < 1) fail("window length 0 in the header");
  // W * T * 4 bytes of losses, compared by division: a corrupt W must not overflow the product
  // (found by fuzz/fuzz_tokens.cpp; tests/fuzz_regressions/tokens/).
  const uint64_t row_bytes = static_cast<uint64_t>(T_) * sizeof(float), payload = map_bytes_ - kRefHeaderBytes;
  if (payload % row_bytes != 0 || payload / row_bytes != read_le<uint64_t>(base_ + 16)) {
    fail(fmt::format("{} bytes on disk but the header says {} windows of {} losses", map_bytes_,
                     read_le<uint64_t>(base_ + 16), T_));
  }
}

RefLosses::~RefLosses() { unmap_file(base_, map_bytes_); }

torch::Tensor RefLosses::rows(const std::vector<int64_t>& windows) const {
  auto out = torch::empty({static_cast<int64_t>(windows.size()), T_}, torch::kFloat);
  auto* o = out.data_ptr<float>();
  for (size_t b = 0; b < windows.size(); ++b) {
    const int64_t w = windows[b];
    TORCH_CHECK(w >= 0 && w < W_, "RefLosses: window ", w, " outside the ", W_, " scored windows of ", path_,
                " (the training pool must not exceed the scored windows)");
    std::memcpy(o + b * T_, base_ + kRefHeaderBytes + static_cast<size_t>(w * T_) * sizeof(float), T_ * sizeof(float));
  }
  return out;
}

void compute_ref_losses(models::CausalLM& model, const TokenShard& shard, int64_t seq_len, int64_t num_windows,
                        int64_t batch_size, const std::string& path, std::ostream* log) {
  const int64_t all = (shard.size() - 1) / seq_len;
  if (num_windows < 1 || num_windows > all) {
    throw std::invalid_argument(fmt::format("compute_ref_losses: {} windows requested, '{}' has {} of T = {}",
                                            num_windows, shard.path(), all, seq_len));
  }
  torch::NoGradGuard ng;
  model->eval();
  const auto device = model_device(model);
  WindowLoader cut(std::shared_ptr<const TokenShard>(&shard, [](const TokenShard*) {}), seq_len, 1, 0, num_windows);
  std::vector<float> losses(static_cast<size_t>(num_windows * seq_len));
  for (int64_t w0 = 0; w0 < num_windows; w0 += batch_size) {
    std::vector<int64_t> ws;
    for (int64_t w = w0; w < std::min(num_windows, w0 + batch_size); ++w) ws.push_back(w);
    Batch b = cut.batch_of(ws);
    auto loss_BT = models::token_losses(model->forward(b.input_ids_BT.to(device)), b.labels_BT.to(device))
                       .to(torch::kCPU, torch::kFloat)
                       .contiguous();
    std::memcpy(&losses[static_cast<size_t>(w0 * seq_len)], loss_BT.data_ptr<float>(), loss_BT.numel() * sizeof(float));
    if (log && (w0 / batch_size) % 50 == 0) {
      *log << fmt::format("  reference losses: {}/{} windows\n", w0 + static_cast<int64_t>(ws.size()), num_windows)
           << std::flush;
    }
  }
  model->train();
  std::vector<uint8_t> h(kRefMagic, kRefMagic + 8);
  put<uint32_t>(h, 1);
  put<uint32_t>(h, static_cast<uint32_t>(seq_len));
  put<uint64_t>(h, static_cast<uint64_t>(num_windows));
  put<uint64_t>(h, static_cast<uint64_t>(shard.size()));
  write_atomically(path, h, losses.data(), losses.size() * sizeof(float));
}

double mean_window_loss(models::CausalLM& model, const TokenShard& shard, int64_t seq_len, int64_t num_windows,
                        int64_t batch_size) {
  torch::NoGradGuard ng;
  const bool was_training = model->is_training();
  model->eval();
  const auto device = model_device(model);
  WindowLoader cut(std::shared_ptr<const TokenShard>(&shard, [](const TokenShard*) {}), seq_len, 1, 0);
  num_windows = std::min(num_windows, cut.num_windows());
  double sum = 0.0;
  int64_t count = 0;
  for (int64_t w0 = 0; w0 < num_windows; w0 += batch_size) {
    std::vector<int64_t> ws;
    for (int64_t w = w0; w < std::min(num_windows, w0 + batch_size); ++w) ws.push_back(w);
    Batch b = cut.batch_of(ws);
    auto loss_BT = models::token_losses(model->forward(b.input_ids_BT.to(device)), b.labels_BT.to(device));
    sum += loss_BT.sum().item<double>();
    count += loss_BT.numel();
  }
  if (was_training) model->train();
  return count ? sum / static_cast<double>(count) : std::nan("");
}

Batch text_batch(const std::string& dir, const std::string& ref_path, int64_t B, int64_t T, int64_t vocab_size) {
  TokenShard shard(dir + "/mix_train.bin");
  RefLosses ref(ref_path);
  const int64_t Tr = ref.seq_len();
  if (T % Tr != 0) {
    throw std::invalid_argument(
        fmt::format("seq_len {} must be a multiple of the reference losses' window {} ({})", T, Tr, ref_path));
  }
  if (ref.num_windows() * Tr < B * T) {
    throw std::invalid_argument(
        fmt::format("the reference losses ({}) cover {} windows of {}, fewer than B x T = {} "
                    "positions",
                    ref_path, ref.num_windows(), Tr, B * T));
  }
  if (static_cast<int64_t>(shard.header().vocab_size) > vocab_size) {
    throw std::invalid_argument(fmt::format("the data's vocabulary ({}) is larger than the model's ({})",
                                            shard.header().vocab_size, vocab_size));
  }
  std::vector<torch::Tensor> ids, refs;
  for (int64_t r = 0; r < B; ++r) {
    ids.push_back(shard.slice(r * T, T + 1));
    std::vector<int64_t> windows;
    for (int64_t j = 0; j < T / Tr; ++j) windows.push_back(r * (T / Tr) + j);
    refs.push_back(ref.rows(windows).reshape({T}));
  }
  const auto all = torch::stack(ids);  // [B, T + 1]
  Batch b;
  b.input_ids_BT = all.narrow(1, 0, T).contiguous();
  b.labels_BT = all.narrow(1, 1, T).contiguous();
  b.ref_loss_BT = torch::stack(refs);
  return b;
}

}  // namespace collider::harness
