// Token data for training runs (the utility experiment): the SentencePiece tokenizer, memory-mapped token shards
// written by scripts/prepare_data.py, a loader that cuts a shard into fixed windows and samples
// them deterministically by (seed, step, rank), and the per-token reference-loss file that RHO-1
// selection reads (stored beside the shards, computed once by the reference model).
// Legend: B batch, T sequence (window length), W windows.
// Tests: tests/test_prepare_data.cpp (sample data from scripts/prepare_data.sh --sample).
#pragma once

#include "harness/components/batch.h"
#include "models/model.h"

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace collider::harness {

// ---- tokenizer ---------------------------------------------------------------------------------
// A SentencePiece model file: ours (prepare_data.py) or the tokenizer.model a Llama-family
// checkpoint ships. Needs the build to have found libsentencepiece (COLLIDER_HAVE_SENTENCEPIECE);
// otherwise the constructor throws saying how to get it.
class Tokenizer {
 public:
  explicit Tokenizer(const std::string& model_path);  // throws std::runtime_error naming the file
  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  std::vector<int32_t> encode(const std::string& text) const;
  std::string decode(const std::vector<int32_t>& ids) const;
  int64_t vocab_size() const;
  int32_t bos_id() const;
  int32_t eos_id() const;
  std::string piece(int32_t id) const;
  static bool available();  // built with libsentencepiece

 private:
  std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_;
  std::string path_;
};

// ---- token shards ------------------------------------------------------------------------------
// Header (32 bytes, little endian): "CLDRTOK1", u32 version (1), u32 bytes per token (2 | 4),
// u64 number of tokens, u32 vocab size, u32 eos id; then the ids.
struct ShardHeader {
  uint32_t version = 1;
  uint32_t token_bytes = 2;
  uint64_t num_tokens = 0;
  uint32_t vocab_size = 0;
  uint32_t eos_id = 0;
};
constexpr size_t kShardHeaderBytes = 32;

// Writes a shard (uint16 when vocab_size <= 65536, else uint32); atomically (tmp + rename).
void write_token_shard(const std::string& path, const std::vector<int64_t>& ids, uint32_t vocab_size, uint32_t eos_id);

// Read-only memory map of one shard; throws std::runtime_error naming the file for a missing
// file, a bad magic or version, or a size that disagrees with the header.
class TokenShard {
 public:
  explicit TokenShard(const std::string& path);
  ~TokenShard();
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;

  const ShardHeader& header() const { return header_; }
  int64_t size() const { return static_cast<int64_t>(header_.num_tokens); }
  int64_t at(int64_t i) const;
  // ids [begin, begin + n) as int64 [n]
  torch::Tensor slice(int64_t begin, int64_t n) const;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  ShardHeader header_;
  const uint8_t* base_ = nullptr;  // start of the mapping
  size_t map_bytes_ = 0;
};

// ---- windows -----------------------------------------------------------------------------------
// Window w of a shard covers tokens [w*T, w*T + T + 1): inputs its first T, labels its last T
// (every position has a label). W = (num_tokens - 1) / T windows; `pool` restricts sampling to
// windows [0, pool) (0 = all). Epoch e visits the pool in a permutation drawn from (seed, e);
// step s of a run with world_size ranks takes global positions [s*B*R, (s+1)*B*R) of the epoch
// sequence, and rank r the B of them at offset r*B. Pure function of (seed, step, rank): a
// resumed run sees the same batches.
class WindowLoader {
 public:
  WindowLoader(std::shared_ptr<const TokenShard> shard, int64_t seq_len, int64_t batch_size, uint64_t seed,
               int64_t pool = 0, int64_t rank = 0, int64_t world_size = 1);

  int64_t num_windows() const { return num_windows_; }  // pool size
  int64_t seq_len() const { return T_; }
  // Window indices of a step's batch on this rank [B].
  std::vector<int64_t> window_ids(int64_t step) const;
  // The batch of window ids: input_ids_BT, labels_BT (no ref losses).
  Batch batch_of(const std::vector<int64_t>& windows) const;
  Batch batch(int64_t step) const { return batch_of(window_ids(step)); }

 private:
  const std::vector<int64_t>& permutation(int64_t epoch) const;

  std::shared_ptr<const TokenShard> shard_;
  int64_t T_, B_;
  uint64_t seed_;
  int64_t num_windows_, rank_, world_size_;
  mutable int64_t cached_epoch_ = -1;
  mutable std::vector<int64_t> perm_;
};

// Deterministic permutation of [0, n) from (seed, epoch): Fisher-Yates on std::mt19937_64 raw
// output (the same sequence on every platform).
std::vector<int64_t> seeded_permutation(int64_t n, uint64_t seed, int64_t epoch);

// ---- reference losses --------------------------------------------------------------------------
// float32 [W, T]: loss (nats) of the reference model on every label position of windows [0, W)
// of a shard cut at T. Header (32 bytes): "CLDRREF1", u32 version 1, u32 T, u64 W, u64 shard
// tokens (guards against a rebuilt shard).
class RefLosses {
 public:
  explicit RefLosses(const std::string& path);  // memory map; throws naming the file
  ~RefLosses();
  RefLosses(const RefLosses&) = delete;
  RefLosses& operator=(const RefLosses&) = delete;
  int64_t seq_len() const { return T_; }
  int64_t num_windows() const { return W_; }
  int64_t shard_tokens() const { return shard_tokens_; }
  // float [B, T] of the given windows
  torch::Tensor rows(const std::vector<int64_t>& windows) const;

 private:
  std::string path_;
  int64_t T_ = 0, W_ = 0, shard_tokens_ = 0;
  const uint8_t* base_ = nullptr;
  size_t map_bytes_ = 0;
};

// Scores windows [0, num_windows) of `shard` at seq_len with `model` (eval, no grad, batches of
// batch_size) and writes the loss file atomically. `log` gets a progress line now and then.
void compute_ref_losses(models::CausalLM& model, const TokenShard& shard, int64_t seq_len, int64_t num_windows,
                        int64_t batch_size, const std::string& path, std::ostream* log = nullptr);

// Mean per-token loss (nats) of `model` on windows [0, num_windows) of a shard (evaluation sets).
double mean_window_loss(models::CausalLM& model, const TokenShard& shard, int64_t seq_len, int64_t num_windows,
                        int64_t batch_size);

// The first B windows of T tokens of DIR/mix_train.bin (scripts/prepare_data.sh) with their
// reference model's per-token losses from `ref_path` (stored per window of the utility
// experiment's length, consecutive windows consecutive positions, so T must be a multiple of it):
// the real-text batch of a timing run scored by excess loss (manifest run.data). Throws
// std::invalid_argument naming what does not fit (too few windows, T, a vocabulary over the model's).
Batch text_batch(const std::string& dir, const std::string& ref_path, int64_t B, int64_t T, int64_t vocab_size);

}  // namespace collider::harness
