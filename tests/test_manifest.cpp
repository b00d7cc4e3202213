// Manifests (harness/config/manifest.h) and the `collider run` front end: each kind of bad manifest
// fails before any compute with its own message naming the file, the key, the value and what is
// allowed, and exits non-zero without writing rows; sweep expansion, exclusion, --set
// precedence, the resolved manifest round trip.
// Run: OMP_NUM_THREADS=1 build-harness/tests/test_manifest
#include "harness/recipes/cli.h"
#include "base/fsutil.h"
#include "harness/config/manifest.h"
#include "harness/config/train_manifest.h"

#include "temp_dir.h"

#include <gtest/gtest.h>

#include <algorithm>

#include <unistd.h>

#include <fstream>
#include <sstream>

namespace ch = collider::harness;
namespace fsu = collider::fsutil;

namespace {

const char* kBase = R"(
name = "t"
[run]
device = "cpu"
warmup_steps = 0
measure_steps = 1
[axes]
model = "tinyllama-debug"
seq_len = [32, 64]
batch_size = 1
filter_ratio = [0.0, 0.5]
method = ["regular", "loss_only", "collider", "masked"]
attention_grad = ["kept_only", "exact_query"]
)";

// The message of the ManifestError that loading `text` (+ sets) raises; "" when none.
std::string error_of(const std::string& text, const std::vector<std::string>& sets = {}) {
  try {
    ch::load_manifest_text(text, "bad.toml", sets);
  } catch (const ch::ManifestError& e) { return e.what(); }
  return "";
}

void expect_mentions(const std::string& msg, std::initializer_list<const char*> parts) {
  ASSERT_FALSE(msg.empty()) << "no error raised";
  for (const char* p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
}

// A scratch directory (std::filesystem is avoided: see base/fsutil.h).
// Scratch directories: tests/temp_dir.h.
struct TempDir : collider::testing::TempDir {
  TempDir() : collider::testing::TempDir("manifest") {}
};

int run_cli(const std::vector<std::string>& args, std::string* err_text = nullptr) {
  std::ostringstream out, err;
  const int rc = ch::run_run_command(args, out, err);
  if (err_text) *err_text = err.str();
  return rc;
}

}  // namespace

TEST(Manifest, ExpandsTheCartesianProductWithAttentionGradOnlyForFilteringBackwards) {
  auto m = ch::load_manifest_text(kBase, "base.toml");
  // 2 seq_len x 2 ratios x (regular + loss_only + 2 collider + 2 masked) = 24.
  EXPECT_EQ(m.num_expanded, 24);
  EXPECT_EQ(m.num_excluded, 0);
  ASSERT_EQ(m.points.size(), 24u);
  int none = 0;
  std::set<std::string> ids;
  for (const auto& p : m.points) {
    ids.insert(p.id());
    if (p.method == "regular" || p.method == "loss_only") {
      EXPECT_EQ(p.attention_grad, "none");
      ++none;
    } else {
      EXPECT_NE(p.attention_grad, "none");
    }
  }
  EXPECT_EQ(none, 8);
  EXPECT_EQ(ids.size(), 24u) << "point ids must be unique";
  EXPECT_EQ(m.points[0].id(), "tinyllama-debug/T32/B1/f0/regular/none");
  EXPECT_EQ(m.points[2].id(), "tinyllama-debug/T32/B1/f0/collider/kept_only");
}

TEST(Manifest, ExcludeTablesDropMatchingPoints) {
  std::string text = std::string(kBase) + R"(
[[exclude]]
method = "regular"
filter_ratio = 0.5
[[exclude]]
seq_len = 64
method = ["collider", "masked"]
attention_grad = "exact_query"
[[exclude]]
model = "tinyllama-debug"
batch_size = 7
)";
  auto m = ch::load_manifest_text(text, "ex.toml");
  // regular at 0.5: 2 points; exact_query collider/masked at T=64: 2 ratios x 2 methods = 4.
  EXPECT_EQ(m.num_expanded, 24);
  EXPECT_EQ(m.num_excluded, 6);
  EXPECT_EQ(m.points.size(), 18u);
  for (const auto& p : m.points) {
    EXPECT_FALSE(p.method == "regular" && p.filter_ratio == 0.5) << p.id();
    EXPECT_FALSE(p.seq_len == 64 && p.attention_grad == "exact_query") << p.id();
  }
  ASSERT_EQ(m.notes.size(), 1u);  // the third exclude matches nothing
  EXPECT_NE(m.notes[0].find("#3"), std::string::npos) << m.notes[0];
}

TEST(Manifest, DefaultsThenFileThenSet) {
  auto m = ch::load_manifest_text(
      kBase, "base.toml",
      {"run.measure_steps=7", "axes.seq_len=[16, 24]", "axes.method=loss_only", "run.score=random", "name=renamed"});
  EXPECT_EQ(m.run.measure_steps, 7);  // --set over the file's 1
  EXPECT_EQ(m.run.warmup_steps, 0);   // the file over the default 2
  EXPECT_EQ(m.run.repetitions, 1);    // default
  EXPECT_DOUBLE_EQ(m.run.lr, 3e-4);   // default
  EXPECT_EQ(m.run.score, "random");   // bare word taken as a string
  EXPECT_EQ(m.name, "renamed");
  ASSERT_EQ(m.points.size(), 4u);  // 2 seq x 2 ratios x loss_only
  EXPECT_EQ(m.points[0].seq_len, 16);
  ASSERT_EQ(m.overrides.size(), 5u);
  EXPECT_NE(m.overrides[0].find("run.measure_steps = 7 (was 1"), std::string::npos) << m.overrides[0];
  EXPECT_EQ(m.run.device, "cpu");
  EXPECT_EQ(m.run.dtype, "fp32");  // auto on cpu
}

TEST(Manifest, ResolvedManifestRoundTrips) {
  std::string text = std::string(kBase) + "[[exclude]]\nmethod = \"masked\"\n";
  auto m = ch::load_manifest_text(text, "base.toml", {"run.seed=9"});
  auto again = ch::load_manifest_text(m.resolved_toml, "resolved.toml");
  ASSERT_EQ(again.points.size(), m.points.size());
  for (size_t i = 0; i < m.points.size(); ++i) EXPECT_EQ(again.points[i].id(), m.points[i].id());
  EXPECT_EQ(again.run.seed, 9);
  EXPECT_NE(ch::default_manifest_toml().find("measure_steps = 5"), std::string::npos);
}

TEST(Manifest, UnknownKeys) {
  expect_mentions(error_of(std::string(kBase) + "[run]\n"), {});  // sanity: duplicate table is a TOML error
  expect_mentions(error_of("name = \"x\"\n[run]\nmeasure_step = 3\n"),
                  {"bad.toml", "run.measure_step", "(= 3)", "unknown", "measure_steps"});
  expect_mentions(error_of("name = \"x\"\nepochs = 3\n"), {"bad.toml", "epochs", "unknown", "name, description"});
  expect_mentions(error_of("[axes]\nlayers = 3\n"), {"bad.toml", "axes.layers", "seq_len"});
  expect_mentions(error_of("[[exclude]]\nlr = 0.1\n"), {"bad.toml", "[[exclude]] #1", "lr", "not an axis"});
}

TEST(Manifest, WrongTypes) {
  expect_mentions(error_of("[run]\nseed = \"abc\"\n"), {"bad.toml", "run.seed", "must be an integer", "abc"});
  expect_mentions(error_of("[run]\nmeasure_steps = 2.5\n"), {"run.measure_steps", "must be an integer", "2.5"});
  expect_mentions(error_of("[axes]\nseq_len = [64, \"long\"]\n"), {"axes.seq_len[1]", "must be an integer", "long"});
  expect_mentions(error_of("[run]\nlayer_timing = 1\n"), {"run.layer_timing", "true or false"});
  expect_mentions(error_of("run = 3\n"), {"bad.toml", "'run'", "must be a table"});
  expect_mentions(error_of("[axes]\nmethod = []\n"), {"axes.method", "empty"});
  expect_mentions(error_of("name = \"x\" x\n"), {"bad.toml:1:", "not valid TOML"});
}

TEST(Manifest, UnknownModelsMethodsAndValues) {
  expect_mentions(error_of("[axes]\nmodel = [\"tinyllama-debug\", \"gpt-5\"]\n"),
                  {"bad.toml", "axes.model", "gpt-5", "tinyllama-mini"});
  expect_mentions(error_of("[axes]\nmethod = \"sparse\"\n"),
                  {"bad.toml", "axes.method", "sparse", "regular, loss_only, collider, masked"});
  expect_mentions(error_of("[axes]\nattention_grad = \"all\"\n"), {"axes.attention_grad", "kept_only, exact_query"});
  expect_mentions(error_of("[run]\ndevice = \"tpu\"\n"), {"run.device", "tpu", "cpu, cuda, auto"});
  expect_mentions(error_of("[run]\ndtype = \"bf16\"\ndevice = \"cpu\"\n"), {"run.dtype", "bf16", "fp32"});
  expect_mentions(error_of("[run]\nmeasure_steps = 0\n"), {"run.measure_steps", ">= 1"});
  expect_mentions(error_of("[axes]\nseq_len = [64, 64]\n"), {"axes.seq_len", "twice"});
  expect_mentions(error_of("name = \"a b\"\n"), {"'name'", "a b"});
  expect_mentions(error_of("[run]\nselection = \"topk\"\n"), {"run.selection", "topk", "per_sequence, batch_topk"});
}

TEST(Manifest, RatiosOutsideTheRangeOrKeepingNothing) {
  expect_mentions(error_of("[axes]\nfilter_ratio = [0.0, 1.0]\nseq_len = 64\n"),
                  {"bad.toml", "axes.filter_ratio", "= 1 ", "[0, 1)"});
  expect_mentions(error_of("[axes]\nfilter_ratio = -0.1\nseq_len = 64\n"), {"axes.filter_ratio", "-0.1", "[0, 1)"});
  expect_mentions(error_of("[axes]\nfilter_ratio = 0.5\nseq_len = 8\nmethod = \"collider\"\n"),
                  {"axes.filter_ratio", "0.5", "keeps no token", "seq_len 8", "align 8"});
}

TEST(Manifest, BadSetOverrides) {
  expect_mentions(error_of(kBase, {"run.measure_steps"}), {"bad.toml", "--set 'run.measure_steps'", "key=value"});
  expect_mentions(error_of(kBase, {"run.warmup=3"}), {"--set 'run.warmup=3'", "run.warmup", "unknown"});
  expect_mentions(error_of(kBase, {"run.seed=abc"}), {"--set 'run.seed=abc'", "must be an integer", "abc"});
  expect_mentions(error_of(kBase, {"axes.filter_ratio=1.5"}), {"--set 'axes.filter_ratio=1.5'", "[0, 1)"});
  expect_mentions(error_of(kBase, {"exclude=[]"}), {"exclude", "command line"});
  // The file's own error still names the file when a --set is present.
  expect_mentions(error_of("[axes]\nmethod = \"x\"\n", {"run.seed=1"}), {"bad.toml", "axes.method"});
}

// Through the CLI: exit code 2, the message on stderr, nothing computed, no result rows.
TEST(Manifest, CliRejectsBadManifestsWithoutWritingRows) {
  TempDir tmp;
  struct Case {
    const char* text;
    std::vector<std::string> sets;
    const char* expect;
  };
  const std::vector<Case> cases = {
      {"[run]\nmesure_steps = 3\n", {}, "run.mesure_steps"},
      {"[run]\nseed = \"x\"\n", {}, "must be an integer"},
      {"[axes]\nmodel = \"nope\"\n", {}, "unknown model preset 'nope'"},
      {"[axes]\nmethod = \"fast\"\n", {}, "axes.method"},
      {"[axes]\nfilter_ratio = 1.0\n", {}, "[0, 1)"},
      {"[axes]\nmodel = \"tinyllama-debug\"\nseq_len = 32\n", {"--set", "run.nope=1"}, "run.nope"},
  };
  int i = 0;
  for (const auto& c : cases) {
    const std::string file = tmp / ("m" + std::to_string(i) + ".toml");
    const std::string out = tmp / ("out" + std::to_string(i++));
    fsu::write_file(file, std::string("name = \"bad\"\n") + c.text);
    std::vector<std::string> args = {file, "--out", out};
    args.insert(args.end(), c.sets.begin(), c.sets.end());
    std::string err;
    EXPECT_EQ(run_cli(args, &err), 2) << c.text;
    EXPECT_NE(err.find(c.expect), std::string::npos) << err;
    EXPECT_NE(err.find(file), std::string::npos) << "message must name the file: " << err;
    EXPECT_FALSE(fsu::exists(fsu::join(out, "results.jsonl"))) << c.text;
    EXPECT_FALSE(fsu::exists(out)) << "nothing may be created for a bad manifest: " << c.text;
  }
  std::string err;
  EXPECT_EQ(run_cli({tmp / "missing.toml"}, &err), 2);
  EXPECT_NE(err.find("cannot open"), std::string::npos) << err;
  EXPECT_EQ(run_cli({"--frobnicate"}, &err), 2);
  EXPECT_EQ(run_cli({tmp / "m0.toml", "--profile-steps", "5"}, &err), 2);
  EXPECT_NE(err.find("--profile-steps"), std::string::npos) << err;
}

TEST(Manifest, DryRunListsPointsAndWritesNothing) {
  TempDir tmp;
  const std::string smoke = std::string(COLLIDER_SOURCE_DIR) + "/experiments/smoke.toml";
  std::ostringstream out, err;
  const int rc = ch::run_run_command({smoke, "--dry-run", "--out", tmp / "o"}, out, err);
  EXPECT_EQ(rc, 0) << err.str();
  EXPECT_NE(out.str().find("11 points (12 expanded, 1 excluded)"), std::string::npos) << out.str();
  EXPECT_NE(out.str().find("tinyllama-debug/T64/B2/f0.5/masked/exact_query"), std::string::npos);
  EXPECT_FALSE(fsu::exists(tmp / "o"));
  // A GPU manifest lists its points on any machine; running it needs the GPU.
  fsu::write_file(tmp / "gpu.toml", "name = \"g\"\n[run]\ndevice = \"cuda\"\n[axes]\nmodel = \"tinyllama-debug\"\n");
  std::ostringstream o2, e2;
  EXPECT_EQ(ch::run_run_command({tmp / "gpu.toml", "--dry-run"}, o2, e2), 0) << e2.str();
  EXPECT_NE(o2.str().find("device cuda, dtype bf16"), std::string::npos) << o2.str();
  if (!torch::cuda::is_available()) {
    std::ostringstream o3, e3;
    EXPECT_EQ(ch::run_run_command({tmp / "gpu.toml", "--out", tmp / "g"}, o3, e3), 2);
    EXPECT_NE(e3.str().find("no CUDA device"), std::string::npos) << e3.str();
  }
}

TEST(Manifest, AaCheckAddsTheRegularPointOnceMoreAtTheEndOfEachGroup) {
  const char* text = R"(
name = "aa"
[run]
device = "cpu"
aa_check = true
[axes]
model = "tinyllama-debug"
seq_len = [16, 32]
filter_ratio = 0.5
method = ["regular", "loss_only"]
[[exclude]]
seq_len = 32
method = "regular"
)";
  const auto m = ch::load_manifest_text(text, "aa.toml");
  // T16: regular, loss_only, regular (A/A copy); T32: loss_only only, so no copy.
  ASSERT_EQ(m.points.size(), 4u);
  EXPECT_EQ(m.num_aa_copies, 1);
  EXPECT_EQ(m.points[2].id(), "tinyllama-debug/T16/B1/f0.5/regular/none/aa");
  EXPECT_TRUE(m.points[2].aa_copy);
  EXPECT_EQ(m.points[2].group_id(), m.points[0].group_id());
  EXPECT_EQ(m.points[3].group_id(), "tinyllama-debug/T32/B1");
  EXPECT_FALSE(m.points[3].aa_copy);
  EXPECT_NE(m.resolved_toml.find("aa_check = true"), std::string::npos) << m.resolved_toml;
}

// run.floor: after each group's points, regular at every T' its collider and forward_drop points
// filter to (one per distinct T'), measured in that group: same group_id, id ending in /floor.
TEST(Manifest, FloorAddsRegularAtTPrimeToEachGroup) {
  const char* text = R"(
name = "floor"
[run]
device = "cpu"
floor = true
aa_check = true
[axes]
model = "tinyllama-debug"
seq_len = [64, 128]
filter_ratio = [0.4, 0.5]
method = ["regular", "loss_only", "collider"]
attention_grad = ["kept_only", "exact_query"]
[[exclude]]
seq_len = 128
method = "collider"
)";
  const auto m = ch::load_manifest_text(text, "floor.toml");
  // T64: kept_count(64, 0.4, 8) = 32 = kept_count(64, 0.5, 8): one floor point; T128: no collider.
  EXPECT_EQ(m.num_floor_points, 1);
  std::vector<std::string> ids;
  for (const auto& p : m.points)
    if (p.group_id() == "tinyllama-debug/T64/B1") ids.push_back(p.id());
  ASSERT_GE(ids.size(), 2u);
  EXPECT_EQ(ids[ids.size() - 2], "tinyllama-debug/T32/B1/f0/regular/none/floor");
  EXPECT_EQ(ids.back(), "tinyllama-debug/T64/B1/f0.4/regular/none/aa") << "the A/A copy stays last";
  const auto floor = std::find_if(m.points.begin(), m.points.end(), [](const auto& p) { return p.floor_of > 0; });
  EXPECT_EQ(floor->floor_of, 64);
  EXPECT_EQ(floor->seq_len, 32);
  EXPECT_EQ(floor->spec.method, collider::models::Method::kRegular);
  EXPECT_NE(m.resolved_toml.find("floor = true"), std::string::npos) << m.resolved_toml;
  EXPECT_NE(m.resolved_toml.find("1 floor points"), std::string::npos) << m.resolved_toml;
}

// forward_drop takes no attention_grad, like regular and loss_only: one point per ratio, "none"
// in its id; it needs models with 3 or more decoder layers (the -debug presets have 2), which an
// [[exclude]] of those points satisfies; its middle layers must keep a token.
TEST(Manifest, ForwardDropIsAMethodWithoutAttentionGrad) {
  auto m = ch::load_manifest_text(R"(
name = "t"
[axes]
model = "tinyllama-mini"
seq_len = [32, 64]
filter_ratio = [0.0, 0.5]
method = ["regular", "forward_drop", "collider"]
attention_grad = ["kept_only", "exact_query"]
)",
                                  "fd.toml");
  // 2 seq_len x 2 ratios x (regular + forward_drop + 2 collider) = 16.
  ASSERT_EQ(m.points.size(), 16u);
  int forward_drop = 0;
  for (const auto& p : m.points) {
    if (p.method != "forward_drop") continue;
    ++forward_drop;
    EXPECT_EQ(p.spec.method, collider::models::Method::kForwardDrop);
    EXPECT_EQ(p.attention_grad, "none") << p.id();
  }
  EXPECT_EQ(forward_drop, 4);
  EXPECT_EQ(m.points[1].id(), "tinyllama-mini/T32/B1/f0/forward_drop/none");

  const std::string debug = R"(
[axes]
model = ["tinyllama-debug", "tinyllama-mini"]
seq_len = 32
filter_ratio = 0.5
method = ["regular", "forward_drop"]
)";
  expect_mentions(error_of(debug), {"bad.toml", "axes.method", "forward_drop", "tinyllama-debug", "3 decoder layers"});
  const auto ok = ch::load_manifest_text(
      std::string(debug) + "[[exclude]]\nmodel = \"tinyllama-debug\"\nmethod = \"forward_drop\"\n", "ex.toml");
  EXPECT_EQ(ok.points.size(), 3u);  // regular x 2 models, forward_drop on the -mini
  expect_mentions(error_of("[axes]\nmodel = \"tinyllama-mini\"\nfilter_ratio = 0.5\nseq_len = 8\nmethod = "
                           "\"forward_drop\"\n"),
                  {"axes.filter_ratio", "keeps no token", "seq_len 8", "align 8"});
  expect_mentions(error_of("[axes]\nmethod = \"sparse\"\n"), {"axes.method", "forward_drop"});
}

// Training manifests: forward_drop runs once per ratio (no attention_grad, no reference scores),
// and is refused on a model with fewer than 3 decoder layers.
TEST(TrainManifest, AcceptsForwardDropOncePerRatio) {
  TempDir d;
  fsu::write_file(d / "m.toml",
                  "name = \"x\"\n[train]\nmodel = \"tinyllama-mini\"\nseq_len = 64\n[axes]\n"
                  "method = [\"regular\", \"forward_drop\", \"collider\"]\nfilter_ratio = [0.4, 0.6]\n");
  const auto m = ch::load_train_manifest(d / "m.toml");
  ASSERT_EQ(m.points.size(), 1u + 2u + 4u);  // regular, forward_drop x 2 ratios, collider x 2 ratios x 2
  EXPECT_EQ(m.points[1].spec.method, collider::models::Method::kForwardDrop);
  EXPECT_EQ(m.points[1].filter_ratio, 0.4);
  EXPECT_EQ(m.points[2].filter_ratio, 0.6);
  EXPECT_EQ(m.points[1].id(m.train), "tinyllama-mini/T64/B8/f0.4/forward_drop/none");
  fsu::write_file(d / "debug.toml",
                  "name = \"x\"\n[train]\nmodel = \"tinyllama-debug\"\n[axes]\nmethod = [\"forward_drop\"]\n");
  try {
    ch::load_train_manifest(d / "debug.toml");
    FAIL() << "a 2-layer model accepted for forward_drop";
  } catch (const ch::ManifestError& e) {
    expect_mentions(e.what(), {"axes.method", "forward_drop", "tinyllama-debug", "3 decoder layers"});
  }
  try {
    ch::load_train_manifest(d / "m.toml", {"train.align=0"});
    FAIL() << "train.align = 0 accepted";
  } catch (const ch::ManifestError& e) { expect_mentions(e.what(), {"train.align", ">= 1"}); }
}

// Training manifests: axes.selection runs loss_only and collider once per selection policy
// (batch_topk: RHO-1's top tokens of the whole batch, ragged rows); regular and forward_drop
// select nothing and run once. per_sequence points keep their ids; batch_topk ones say so.
TEST(TrainManifest, SelectionAxisRunsTheSelectingMethodsOncePerPolicy) {
  TempDir d;
  fsu::write_file(d / "m.toml",
                  "name = \"x\"\n[train]\nmodel = \"tinyllama-mini\"\nseq_len = 64\n[axes]\n"
                  "method = [\"regular\", \"loss_only\", \"collider\", \"forward_drop\"]\n"
                  "attention_grad = [\"exact_query\"]\nselection = [\"per_sequence\", \"batch_topk\"]\n");
  const auto m = ch::load_train_manifest(d / "m.toml");
  ASSERT_EQ(m.points.size(), 1u + 2u + 2u + 1u);
  std::vector<std::string> ids;
  for (const auto& p : m.points) ids.push_back(p.id(m.train));
  EXPECT_EQ(ids, (std::vector<std::string>{"tinyllama-mini/T64/B8/f0/regular/none",
                                           "tinyllama-mini/T64/B8/f0.4/loss_only/none",
                                           "tinyllama-mini/T64/B8/f0.4/loss_only/none/batch_topk",
                                           "tinyllama-mini/T64/B8/f0.4/collider/exact_query",
                                           "tinyllama-mini/T64/B8/f0.4/collider/exact_query/batch_topk",
                                           "tinyllama-mini/T64/B8/f0.4/forward_drop/none"}));
  EXPECT_EQ(m.points[2].spec.policy, collider::SelectPolicy::kBatchTopK);
  EXPECT_EQ(m.points[3].spec.policy, collider::SelectPolicy::kPerSequence);
  EXPECT_NE(m.resolved_toml.find("selection = [ 'per_sequence', 'batch_topk' ]"), std::string::npos)
      << m.resolved_toml;
  try {
    ch::load_train_manifest(d / "m.toml", {"axes.selection=[\"top\"]"});
    FAIL() << "an unknown selection accepted";
  } catch (const ch::ManifestError& e) {
    expect_mentions(e.what(), {"axes.selection", "top", "per_sequence, batch_topk"});
  }
}
