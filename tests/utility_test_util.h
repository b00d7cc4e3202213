// Sample training data shared by tests/test_utility.cpp, tests/test_distributed_train.cpp and the
// reliability tests: scripts/prepare_data.sh --sample (real Debian text; needs network or cached
// .debs) into one directory of the build tree (COLLIDER_SAMPLE_DATA_DIR), which the tests only read;
// the script's lock makes a test started while another prepares it wait, then find it complete.
// And its byte-level copy, on which the -debug presets (vocab 256) train (one per test).
#pragma once

#include "base/fsutil.h"
#include "harness/components/token_data.h"

#include <fmt/format.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

namespace collider::testing {

// The shared sample's directory (prepared by prepare_sample_data(shared_sample_dir(), ...)).
inline std::string shared_sample_dir() { return COLLIDER_SAMPLE_DATA_DIR; }

// Runs scripts/prepare_data.sh --sample into `data_dir` (output to `log_path`); returns the
// std::system status (exit status 3: no network and no cached .deb files).
inline int prepare_sample_data(const std::string& data_dir, const std::string& log_path) {
  const std::string cmd = fmt::format("'{}/scripts/prepare_data.sh' --out '{}' --sample > '{}' 2>&1",
                                      COLLIDER_SOURCE_DIR, data_dir, log_path);
  return std::system(cmd.c_str());
}

// Byte-level copy of the sample (the C++ tokenizer decodes every split back to its UTF-8 text;
// each byte becomes one token) so that the -debug presets (vocab 256) train on the same real text.
inline std::string byte_level_data(const std::string& src, const std::string& dst) {
  using fsutil::join;
  fsutil::make_dirs(dst);
  harness::Tokenizer tok(join(src, "tokenizer.model"));
  for (const char* split : {"curated_train", "curated_eval", "mix_train", "mix_eval"}) {
    harness::TokenShard shard(join(src, std::string(split) + ".bin"));
    auto ids_t = shard.slice(0, shard.size());
    std::vector<int32_t> ids(ids_t.data_ptr<int64_t>(), ids_t.data_ptr<int64_t>() + shard.size());
    const std::string text = tok.decode(ids);
    std::vector<int64_t> bytes;
    for (unsigned char ch : text) bytes.push_back(ch);
    harness::write_token_shard(join(dst, std::string(split) + ".bin"), bytes, 256, 0);
  }
  return dst;
}

}  // namespace collider::testing
