// `collider score`: per-token losses (nats) of a Hugging Face-layout checkpoint over token ids
// (DESIGN.md section 5). This is RHO-1's reference-scoring step and the command-line check that
// our models reproduce the reference implementations.
//   build/collider score --checkpoint DIR --tokens FILE [--out FILE]
//                        [--batch-size N] [--device cpu|cuda] [--dtype float32|bfloat16|float16]
// FILE: one sequence per line, token ids separated by spaces. Output (stdout without --out): JSONL
// {"seq": i, "losses": [...]}, losses[t] = loss of predicting token t+1 from tokens 0..t.
// Tests: tests/test_hf_agreement.cpp (against transformers' own losses).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "models/model.h"

namespace collider::harness {

// Entry point for `collider score ...`: `args` are the words after the program name; a leading
// "score" is skipped. Returns 0 on success, 1 on an error (message on stderr), 2 on a usage error.
int run_score(const std::vector<std::string>& args);

// Reads a token file (one sequence per line). Throws std::runtime_error naming the file, the line
// and the offending word for a missing file, an empty line, a word that is not an integer, or an
// id outside [0, vocab_size).
std::vector<std::vector<int64_t>> read_token_file(const std::string& path, int64_t vocab_size);

// Per-token losses of each sequence (T-1 values for T tokens) under `model` in eval mode, no
// gradient; consecutive sequences of equal length are batched up to `batch_size`. Throws when a
// sequence is longer than the model's max_position or a loss is not finite.
std::vector<std::vector<float>> score_sequences(models::CausalLM& model,
                                                const std::vector<std::vector<int64_t>>& sequences,
                                                int64_t batch_size = 8);

// One output line: {"seq": i, "losses": [...]} with each float in its shortest exact form.
std::string score_json_line(int64_t seq, const std::vector<float>& losses);

}  // namespace collider::harness
