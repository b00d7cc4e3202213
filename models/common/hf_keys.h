// Internal: the keys of one Hugging Face config.json, read with errors that name the file, the key
// and what was found. Shared by the reader of the keys every family has (models/hf_config.cpp)
// and each family's own mapping (its Architecture's read_hf / write_hf, in llama.cpp, qwen2.cpp,
// phi.cpp, mixtral.cpp). Tests: tests/test_checkpoint.cpp.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

namespace collider::models::detail {

class HfKeys {
 public:
  // `source` names the file in errors.
  HfKeys(const nlohmann::json& j, std::string source) : j_(j), source_(std::move(source)) {}

  // std::invalid_argument "config 'SOURCE': WHAT".
  [[noreturn]] void fail(const std::string& what) const;
  // The key when present and not null, else nullptr.
  const nlohmann::json* field(const char* key) const;
  int64_t positive_int(const char* key) const;  // required
  double number(const char* key, double fallback) const;
  bool boolean(const char* key, bool fallback) const;
  std::string string(const char* key) const;  // "" when absent or not a string
  // Refuses `key` = true, saying why ("our Llama has no attention biases").
  void require_false(const char* key, const char* why) const;
  // A RoPE parameter: rope_parameters' (transformers 5) when it has one, else the top level's
  // (transformers < 5), else fallback.
  double rope_number(const char* key, double fallback) const;

 private:
  const nlohmann::json& j_;
  std::string source_;
};

}  // namespace collider::models::detail
