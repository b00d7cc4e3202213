// The fuzz targets' checks (fuzz/fuzz_checks.h) in the ordinary build: every committed seed
// (fuzz/seeds/<target>/) and every input a fuzzer once crashed on (tests/fuzz_regressions/<target>/)
// must be accepted sanely or rejected with the parser's own error. Plus one test per fixed finding
// that names the clean error it now gets. scripts/fuzz.sh runs the fuzzers themselves.
//   build/tests/test_fuzz_regressions
#include "fuzz/fuzz_checks.h"

#include "base/fsutil.h"
#include "temp_dir.h"

#include <dirent.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

namespace {

namespace cf = collider::fuzz;
namespace ch = collider::harness;
namespace fsu = collider::fsutil;

std::vector<std::string> files_in(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n[0] != '.') out.push_back(fsu::join(dir, n));
    }
    ::closedir(d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

using Check = std::function<void(const uint8_t*, size_t)>;

// Runs `check` on every file of the target's seed and regression directories; returns the count.
size_t replay(const std::string& target, const Check& check) {
  size_t n = 0;
  for (const auto& dir : {std::string(COLLIDER_SOURCE_DIR) + "/fuzz/seeds/" + target,
                          std::string(COLLIDER_SOURCE_DIR) + "/tests/fuzz_regressions/" + target}) {
    for (const auto& path : files_in(dir)) {
      SCOPED_TRACE(path);
      const std::string bytes = fsu::read_file(path);
      try {
        check(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
      } catch (const cf::Violation& v) { ADD_FAILURE() << v.what; } catch (const std::exception& e) {
        ADD_FAILURE() << "escaped the parser's own error type: " << e.what();
      }
      ++n;
    }
  }
  return n;
}

TEST(FuzzRegressions, SafetensorsSeedsAndFindings) { EXPECT_GE(replay("safetensors", cf::check_safetensors), 3u); }
TEST(FuzzRegressions, ManifestSeedsAndFindings) { EXPECT_GE(replay("manifest", cf::check_manifest), 8u); }
TEST(FuzzRegressions, TokensSeedsAndFindings) { EXPECT_GE(replay("tokens", cf::check_tokens), 4u); }
TEST(FuzzRegressions, PlanSeedsAndFindings) { EXPECT_GE(replay("plan", cf::check_plan), 2u); }

}  // namespace

namespace {

std::string regression(const std::string& target, const std::string& name) {
  return std::string(COLLIDER_SOURCE_DIR) + "/tests/fuzz_regressions/" + target + "/" + name;
}

template <typename E, typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) { return e.what(); }
  return "(no error)";
}

// The findings of scripts/fuzz.sh, each now a clean error that names the problem.
TEST(FuzzFindings, ASetIntoAKeyThatIsNotATableIsAManifestError) {
  // Was: a null toml::table dereferenced in the training loader's --set (UBSan, fuzz_manifest).
  const std::string text = fsu::read_file(regression("manifest", "set_into_a_key_that_is_not_a_table.toml"));
  collider::testing::TempDir d("fuzz_regressions");
  fsu::write_file(d / "m.toml", "axes = \"x\"\n[train]\nmodel = \"tinyllama-debug\"\n");
  const std::string msg =
      error_of<ch::ManifestError>([&] { ch::load_train_manifest(d / "m.toml", {"axes.method=x"}); });
  EXPECT_NE(msg.find("'axes' is not a table"), std::string::npos) << msg;
  EXPECT_NE(msg.find("--set 'axes.method=x'"), std::string::npos) << msg;
  EXPECT_NO_THROW(cf::check_manifest(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
}

TEST(FuzzFindings, AManifestWhoseExclusionsRemoveEveryPointIsAManifestError) {
  // Was: accepted with zero points (a run that silently does nothing; fuzz_manifest).
  const std::string text = fsu::read_file(regression("manifest", "every_point_excluded.toml"));
  const std::string msg =
      error_of<ch::ManifestError>([&] { ch::load_manifest_text(text, "excluded.toml", {}, /*check_device=*/false); });
  EXPECT_NE(msg.find("excluded.toml: [[exclude]] removes all 2 points"), std::string::npos) << msg;
}

TEST(FuzzFindings, AnExcludeWithASubnormalFilterRatioIsResolved) {
  // Was: std::out_of_range from std::stod escaping load_manifest_text while it wrote the resolved
  // manifest, for an [[exclude]] filter_ratio of 4.1e-321 (fuzz_manifest).
  std::string text = fsu::read_file(regression("manifest", "exclude_with_a_subnormal_filter_ratio.toml"));
  text.resize(text.find("\n#--set\n") + 1);
  ASSERT_NE(text.find("filter_ratio = 0.41e-320"), std::string::npos);
  const ch::Manifest m = ch::load_manifest_text(text, "subnormal.toml", {}, /*check_device=*/false);
  EXPECT_EQ(m.points.size(), 1u);
  EXPECT_NE(m.resolved_toml.find("[[exclude]]"), std::string::npos) << m.resolved_toml;
  const ch::Manifest again = ch::load_manifest_text(m.resolved_toml, "resolved.toml", {}, false);
  EXPECT_EQ(again.points.size(), m.points.size());
}

TEST(FuzzFindings, ReferenceLossesWhoseSizeOverflowsAreRejected) {
  // Was: W * T overflowed int64 in the size check (UBSan, fuzz_tokens).
  const std::string path = regression("tokens", "ref_losses_size_overflows.f32");
  const std::string msg = error_of<std::runtime_error>([&] { ch::RefLosses r(path); });
  EXPECT_NE(msg.find("bytes on disk but the header says"), std::string::npos) << msg;
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
}

TEST(FuzzFindings, AShardWhoseTokenCountOverflowsIsRejected) {
  // Was: num_tokens * token_bytes wrapped around to the file size: accepted with 2^63 + 6 tokens,
  // reads far outside the mapping (fuzz_tokens).
  const std::string path = regression("tokens", "shard_token_count_overflows.bin");
  const std::string msg = error_of<std::runtime_error>([&] { ch::TokenShard s(path); });
  EXPECT_NE(msg.find("bytes on disk but the header says"), std::string::npos) << msg;
}

TEST(FuzzFindings, APlanBlockerLineWithoutItsReasonIsAColliderError) {
  // Was: std::out_of_range from substr escaping Plan::from_string (fuzz_plan).
  const std::string text = fsu::read_file(regression("plan", "blocker_without_text.plan"));
  const std::string msg = error_of<collider::Error>([&] { collider::Plan::from_string(text); });
  EXPECT_NE(msg.find("line 15: blocker without its reason"), std::string::npos) << msg;
}

}  // namespace
