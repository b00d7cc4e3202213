// Utility pipeline: data preparation on a small sample of the real Debian text
// (scripts/prepare_data.sh --sample; needs network or cached .debs), the SentencePiece tokenizer
// from C++ (round trip, agreement with the Python-written shards), token-shard and window-loader
// determinism, stored reference losses equal to a recomputation, and a 20-step training run of
// every method (regular, loss_only, collider kept_only / exact_query) at -debug size through
// `collider run` on a training manifest, with --resume; forward_drop (tinyllama-mini) trains and
// resumes to the same losses.
//   OMP_NUM_THREADS=1 build/tests/test_utility
#include "base/fsutil.h"
#include "harness/run/results.h"
#include "harness/components/token_data.h"
#include "harness/recipes/train_run.h"
#include "models/hf_tensors.h"
#include "models/model.h"
#include "temp_dir.h"
#include "utility_test_util.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include <sys/wait.h>

namespace collider {
namespace {

using fsutil::join;
using fsutil::exists;
using fsutil::read_file;

// One sample preparation shared by every test of this file.
class Utility : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::TempDir("utility");
    status_ = testing::prepare_sample_data(data(), *dir_ / "prepare.log");  // shared, read only
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  void SetUp() override {
    if (WIFEXITED(status_) && WEXITSTATUS(status_) == 3) {
      GTEST_SKIP() << "no network and no cached .deb files:\n" << read_file(*dir_ / "prepare.log");
    }
    ASSERT_EQ(status_, 0) << "prepare_data.sh --sample failed:\n" << read_file(*dir_ / "prepare.log");
  }
  static std::string data() { return testing::shared_sample_dir(); }
  static nlohmann::json meta() { return nlohmann::json::parse(read_file(join(data(), "meta.json"))); }

  static testing::TempDir* dir_;
  static int status_;
};
testing::TempDir* Utility::dir_ = nullptr;
int Utility::status_ = -1;

TEST_F(Utility, SamplePreparationWritesFourDisjointSplitsOfRealText) {
  const auto m = meta();
  for (const char* split : {"curated_train", "curated_eval", "mix_train", "mix_eval"}) {
    SCOPED_TRACE(split);
    harness::TokenShard shard(join(data(), std::string(split) + ".bin"));
    EXPECT_EQ(shard.header().token_bytes, 2u);
    EXPECT_EQ(shard.header().vocab_size, m["vocab_size"].get<uint32_t>());
    EXPECT_EQ(shard.size(), m["splits"][split]["tokens"].get<int64_t>());
    // Documents are joined with EOS: one EOS per piece, and ids stay inside the vocabulary.
    auto ids = shard.slice(0, shard.size());
    EXPECT_EQ((ids == static_cast<int64_t>(shard.header().eos_id)).sum().item<int64_t>(),
              m["splits"][split]["pieces"].get<int64_t>());
    EXPECT_LT(ids.max().item<int64_t>(), static_cast<int64_t>(shard.header().vocab_size));
    EXPECT_GT(m["splits"][split]["bytes"].get<int64_t>(), 1000);
  }
  // The curated splits come from the Python documentation, the mixture also from other packages.
  EXPECT_NE(read_file(join(data(), "curated_train.txt.sample")).find(".."), std::string::npos);  // reST directives
  EXPECT_GT(m["sources"]["manpages"]["pieces"].get<int64_t>(), 0);
  EXPECT_GT(m["sources"]["libpython3.11-stdlib"]["pieces"].get<int64_t>(), 0);
  // Idempotent: a second call leaves the data as it is.
  const std::string before = read_file(join(data(), "meta.json"));
  ASSERT_EQ(std::system(fmt::format("'{}/scripts/prepare_data.sh' --out '{}' --sample > /dev/null 2>&1",
                                    COLLIDER_SOURCE_DIR, data())
                            .c_str()),
            0);
  EXPECT_EQ(read_file(join(data(), "meta.json")), before);
}

TEST_F(Utility, TokenizerRoundTripsAnyTextAndDecodesThePythonShards) {
  ASSERT_TRUE(harness::Tokenizer::available()) << "build without libsentencepiece-dev";
  harness::Tokenizer tok(join(data(), "tokenizer.model"));
  EXPECT_EQ(tok.vocab_size(), meta()["vocab_size"].get<int64_t>());
  EXPECT_EQ(tok.eos_id(), meta()["eos_id"].get<int32_t>());
  // Identity normalisation + byte fallback: newlines, indentation, tabs and non-Latin text survive.
  const std::string text = "def f(x):\n    return x  # \u00fcber \u2713 \u65e5\u672c\n\n\tdone.\n";
  const auto ids = tok.encode(text);
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(tok.decode(ids), text);
  EXPECT_THROW(tok.decode({static_cast<int32_t>(tok.vocab_size())}), std::invalid_argument);
  // The C++ tokenizer decodes what Python's sentencepiece wrote: the first document of the split
  // is the start of its text sample.
  harness::TokenShard shard(join(data(), "curated_eval.bin"));
  std::vector<int32_t> first;
  for (int64_t i = 0; i < shard.size() && shard.at(i) != tok.eos_id(); ++i)
    first.push_back(static_cast<int32_t>(shard.at(i)));
  const std::string doc = tok.decode(first), sample = read_file(join(data(), "curated_eval.txt.sample"));
  const size_t n = std::min<size_t>(doc.size(), sample.size());
  ASSERT_GT(n, 100u);
  EXPECT_EQ(doc.substr(0, n), sample.substr(0, n));
  EXPECT_EQ(tok.encode(doc), first);
  EXPECT_THROW(harness::Tokenizer(join(data(), "missing.model")), std::runtime_error);
}

TEST_F(Utility, ShardsRejectCorruptionAndRoundTrip) {
  testing::TempDir d("shard");
  const std::vector<int64_t> ids = {5, 0, 65535, 17};
  harness::write_token_shard(d / "a.bin", ids, 65536, 0);
  harness::TokenShard a(d / "a.bin");
  EXPECT_EQ(a.header().token_bytes, 2u);
  EXPECT_EQ(a.slice(0, 4).index({2}).item<int64_t>(), 65535);
  harness::write_token_shard(d / "b.bin", {70000, 1}, 100000, 1);
  harness::TokenShard b(d / "b.bin");
  EXPECT_EQ(b.header().token_bytes, 4u);
  EXPECT_EQ(b.at(0), 70000);
  EXPECT_THROW(harness::write_token_shard(d / "c.bin", {300}, 256, 0), std::invalid_argument);
  std::string bytes = read_file(d / "a.bin");
  fsutil::write_file(d / "cut.bin", bytes.substr(0, bytes.size() - 1));
  EXPECT_THROW(harness::TokenShard(d / "cut.bin"), std::runtime_error);
  bytes[0] = 'X';
  fsutil::write_file(d / "magic.bin", bytes);
  EXPECT_THROW(harness::TokenShard(d / "magic.bin"), std::runtime_error);
}

TEST_F(Utility, LoaderIsDeterministicBySeedAndSplitsRanks) {
  auto shard = std::make_shared<harness::TokenShard>(join(data(), "mix_train.bin"));
  const int64_t T = 64, B = 4;
  harness::WindowLoader a(shard, T, B, 7), b(shard, T, B, 7), c(shard, T, B, 8);
  std::set<int64_t> seen;
  const int64_t per_epoch = a.num_windows() / B;
  bool differs = false;
  for (int64_t s = 0; s < per_epoch; ++s) {
    const auto w = a.window_ids(s);
    EXPECT_EQ(w, b.window_ids(s));
    differs |= w != c.window_ids(s);
    seen.insert(w.begin(), w.end());
  }
  EXPECT_TRUE(differs);
  EXPECT_EQ(static_cast<int64_t>(seen.size()), per_epoch * B);  // an epoch never repeats a window
  EXPECT_NE(a.window_ids(per_epoch), a.window_ids(0));          // the next epoch is another permutation
  // Labels are the inputs shifted by one; windows are the shard's tokens [w*T, w*T + T + 1).
  const auto w0 = a.window_ids(3);
  auto batch = a.batch(3);
  EXPECT_TRUE(torch::equal(batch.labels_BT.narrow(1, 0, T - 1), batch.input_ids_BT.narrow(1, 1, T - 1)));
  EXPECT_TRUE(torch::equal(batch.input_ids_BT[1], shard->slice(w0[1] * T, T)));
  EXPECT_EQ(batch.labels_BT[2][T - 1].item<int64_t>(), shard->at(w0[2] * T + T));
  // Two ranks of batch B together see the global batch 2B of one rank, without overlap.
  harness::WindowLoader whole(shard, T, 2 * B, 7), r0(shard, T, B, 7, 0, 0, 2), r1(shard, T, B, 7, 0, 1, 2);
  for (int64_t s : {0, 5}) {
    auto g = whole.window_ids(s), x = r0.window_ids(s), y = r1.window_ids(s);
    x.insert(x.end(), y.begin(), y.end());
    EXPECT_EQ(x, g);
  }
  EXPECT_THROW(harness::WindowLoader(shard, T, B, 7, 0, 2, 2), std::invalid_argument);
  EXPECT_THROW(harness::WindowLoader(shard, T, B, 7, a.num_windows() + 1), std::invalid_argument);
}

using testing::byte_level_data;

std::vector<nlohmann::json> rows_of(const std::string& dir) {
  return harness::read_results(join(dir, "results.jsonl"), false).rows;
}

TEST_F(Utility, EveryMethodTrains20StepsAndReferenceLossesMatchARecomputation) {
  ASSERT_TRUE(harness::Tokenizer::available());
  testing::TempDir d("train");
  const std::string bytes_dir = byte_level_data(data(), d / "bytes");
  const std::string manifest = d / "utility.toml";
  fsutil::write_file(manifest, fmt::format(R"(name = "utility_test"
[data]
dir = "{}"
[train]
model = "tinyllama-debug"
seq_len = 32
batch_size = 2
steps = 20
warmup_steps = 2
eval_every = 10
eval_tokens = 128
eval_batch_size = 4
checkpoint_every = 10
log_every = 5
threads = 1
[reference]
steps = 10
batch_size = 2
[axes]
method = ["regular", "loss_only", "collider"]
attention_grad = ["kept_only", "exact_query"]
filter_ratio = [0.4]
)",
                                                    bytes_dir));
  std::ostringstream out, err;
  const std::string run_dir = d / "run";
  ASSERT_EQ(harness::run_train_command(manifest, {}, run_dir, false, false, out, err), 0) << err.str();
  EXPECT_NE(err.str().find("ETA"), std::string::npos);
  const auto rows = rows_of(run_dir);
  std::map<std::string, std::vector<nlohmann::json>> by_point;
  std::map<std::string, std::vector<nlohmann::json>> train_rows;
  for (const auto& r : rows) {
    (r["eval_set"].is_null() ? train_rows : by_point)[r["point_id"].get<std::string>()].push_back(r);
  }
  ASSERT_EQ(by_point.size(), 4u);
  std::map<std::string, double> backprop;
  for (const auto& [pid, rs] : by_point) {
    SCOPED_TRACE(pid);
    ASSERT_EQ(rs.size(), 4u);               // 2 evaluations x 2 eval sets
    ASSERT_EQ(train_rows[pid].size(), 4u);  // training loss every 5 steps
    EXPECT_TRUE(std::isfinite(train_rows[pid].back()["train_loss"].get<double>()));
    const auto& last = rs.back();
    EXPECT_EQ(last["status"], "ok");
    EXPECT_EQ(last["step"].get<int64_t>(), 20);
    EXPECT_TRUE(last["final"].get<bool>());
    EXPECT_TRUE(std::isfinite(last["val_loss"].get<double>()));
    EXPECT_NEAR(last["val_ppl"].get<double>(), std::exp(last["val_loss"].get<double>()), 1e-6);
    EXPECT_LT(last["val_loss"].get<double>(), std::log(256.0));  // learnt something from the byte text
    EXPECT_EQ(last["tokens_seen"].get<double>(), 20 * 2 * 32);
    EXPECT_GT(last["elapsed_s"].get<double>(), 0);
    backprop[last["method"].get<std::string>() + "/" + last["attention_grad"].get<std::string>()] =
        last["tokens_backprop"].get<double>();
  }
  EXPECT_EQ(backprop["regular/none"], 20 * 2 * 32);
  EXPECT_LT(backprop["loss_only/none"], 0.7 * 20 * 2 * 32);  // 40% filtered (drop count rounded up to 8)
  EXPECT_EQ(backprop["collider/kept_only"], backprop["loss_only/none"]);
  EXPECT_EQ(backprop["collider/exact_query"], backprop["loss_only/none"]);
  // Resume: every run finished, nothing is rerun, no row is added; checkpoints were cleaned up.
  std::ostringstream err2;
  ASSERT_EQ(harness::run_train_command(manifest, {}, run_dir, false, true, out, err2), 0) << err2.str();
  EXPECT_EQ(rows_of(run_dir).size(), rows.size());
  EXPECT_NE(err2.str().find("already finished"), std::string::npos);
  // Without --resume an existing results file is refused.
  std::ostringstream err3;
  EXPECT_EQ(harness::run_train_command(manifest, {}, run_dir, false, false, out, err3), 1);

  // The stored reference losses equal a recomputation with the saved reference model.
  const std::string ref_dir = join(join(bytes_dir, "reference"), rows.front()["reference"].get<std::string>());
  harness::RefLosses stored(join(ref_dir, "mix_train.T32.W40.reflosses.f32"));
  ASSERT_EQ(stored.num_windows(), 40);  // pool = steps x batch_size
  auto ref_model = models::load_hf_model(join(ref_dir, "model"));
  ref_model->eval();
  auto shard = std::make_shared<harness::TokenShard>(join(bytes_dir, "mix_train.bin"));
  harness::WindowLoader cut(shard, 32, 1, 0, 40);
  const std::vector<int64_t> ws = {0, 17, 39};
  torch::NoGradGuard ng;
  auto b = cut.batch_of(ws);
  auto recomputed = models::token_losses(ref_model->forward(b.input_ids_BT), b.labels_BT);
  EXPECT_TRUE(torch::allclose(stored.rows(ws), recomputed, 1e-5, 1e-5))
      << (stored.rows(ws) - recomputed).abs().max().item<double>();
  // Windows outside the scored pool are refused.
  EXPECT_THROW(stored.rows({40}), c10::Error);
}

TEST_F(Utility, AKilledRunResumesFromItsCheckpointToTheSameResult) {
  testing::TempDir d("resume");
  const std::string bytes_dir = byte_level_data(data(), d / "bytes");
  const std::string manifest = d / "utility.toml";
  fsutil::write_file(manifest, fmt::format(R"(name = "utility_resume"
[data]
dir = "{}"
[train]
model = "tinyllama-debug"
seq_len = 32
batch_size = 2
steps = 12
warmup_steps = 2
eval_every = 6
eval_tokens = 128
checkpoint_every = 6
log_every = 3
threads = 1
[reference]
steps = 4
batch_size = 2
[axes]
method = ["collider"]
attention_grad = ["exact_query"]
)",
                                                    bytes_dir));
  std::ostringstream out, err;
  ASSERT_EQ(harness::run_train_command(manifest, {}, d / "whole", false, false, out, err), 0) << err.str();
  // Killed right after the checkpoint of step 6, then resumed: the same rows, the same losses.
  EXPECT_EQ(harness::run_train_command(manifest, {"train.stop_after=6"}, d / "killed", false, false, out, err), 1);
  const auto partial = rows_of(d / "killed");
  ASSERT_FALSE(partial.empty());
  EXPECT_EQ(partial.back()["step"].get<int64_t>(), 6);
  std::ostringstream err2;
  ASSERT_EQ(harness::run_train_command(manifest, {}, d / "killed", false, true, out, err2), 0) << err2.str();
  EXPECT_NE(err2.str().find("resumed at step 6"), std::string::npos) << err2.str();
  const auto a = rows_of(d / "whole"), b = rows_of(d / "killed");
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(a[i]["step"], b[i]["step"]);
    EXPECT_EQ(a[i]["eval_set"], b[i]["eval_set"]);
    for (const char* k : {"val_loss", "train_loss"}) {
      if (a[i].contains(k)) { EXPECT_NEAR(a[i][k].get<double>(), b[i][k].get<double>(), 1e-6); }
    }
  }
}

// forward_drop trains (tinyllama-mini: 4 layers; the -debug presets have 2) with every token's
// loss back-propagated, and a run killed after a checkpoint resumes to the same losses: the
// middle layers' subsets of the remaining steps are the ones the whole run drew.
TEST_F(Utility, ForwardDropTrainsAndResumesToTheSameResult) {
  testing::TempDir d("forward_drop");
  const std::string bytes_dir = byte_level_data(data(), d / "bytes");
  const std::string manifest = d / "utility.toml";
  fsutil::write_file(manifest, fmt::format(R"(name = "utility_forward_drop"
[data]
dir = "{}"
[train]
model = "tinyllama-mini"
seq_len = 32
batch_size = 2
steps = 8
warmup_steps = 2
eval_every = 4
eval_tokens = 128
checkpoint_every = 4
log_every = 2
threads = 1
[reference]
steps = 2
batch_size = 2
[axes]
method = ["forward_drop"]
filter_ratio = [0.5]
)",
                                                    bytes_dir));
  std::ostringstream out, err;
  ASSERT_EQ(harness::run_train_command(manifest, {}, d / "whole", false, false, out, err), 0) << err.str();
  EXPECT_EQ(harness::run_train_command(manifest, {"train.stop_after=4"}, d / "killed", false, false, out, err), 1);
  std::ostringstream err2;
  ASSERT_EQ(harness::run_train_command(manifest, {}, d / "killed", false, true, out, err2), 0) << err2.str();
  EXPECT_NE(err2.str().find("resumed at step 4"), std::string::npos) << err2.str();
  const auto a = rows_of(d / "whole"), b = rows_of(d / "killed");
  ASSERT_EQ(a.size(), b.size());
  ASSERT_FALSE(a.empty());
  EXPECT_EQ(a.back()["point_id"], "tinyllama-mini/T32/B2/f0.5/forward_drop/none");
  EXPECT_EQ(a.back()["score"], "none");
  EXPECT_EQ(a.back()["tokens_backprop"].get<double>(), 8 * 2 * 32);  // every token's loss
  for (size_t i = 0; i < a.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(a[i]["step"], b[i]["step"]);
    for (const char* k : {"val_loss", "train_loss"}) {
      if (a[i].contains(k)) {
        EXPECT_TRUE(std::isfinite(a[i][k].get<double>()));
        EXPECT_NEAR(a[i][k].get<double>(), b[i][k].get<double>(), 1e-6);
      }
    }
  }
}

// RHO-1's own selection in a training run (axes.selection = batch_topk): the top 60% of the
// whole batch by excess loss, so rows keep different counts, through Collider's backward and
// loss_only's. The total kept count per step is fixed by the batch, so both back-propagate the
// same tokens; rows name the selection, and per_sequence points keep their ids.
TEST_F(Utility, BatchTopKSelectionTrainsLossOnlyAndCollider) {
  testing::TempDir d("batch_topk");
  const std::string bytes_dir = byte_level_data(data(), d / "bytes");
  const std::string manifest = d / "utility.toml";
  fsutil::write_file(manifest, fmt::format(R"(name = "utility_batch_topk"
[data]
dir = "{}"
[train]
model = "tinyllama-debug"
seq_len = 32
batch_size = 3
steps = 8
warmup_steps = 2
eval_every = 8
eval_tokens = 128
checkpoint_every = 4
log_every = 4
threads = 1
[reference]
steps = 4
batch_size = 2
[axes]
method = ["loss_only", "collider"]
attention_grad = ["exact_query"]
filter_ratio = [0.4]
selection = ["per_sequence", "batch_topk"]
)",
                                                    bytes_dir));
  std::ostringstream out, err;
  ASSERT_EQ(harness::run_train_command(manifest, {}, d / "run", false, false, out, err), 0) << err.str();
  std::map<std::string, nlohmann::json> last;
  for (const auto& r : rows_of(d / "run")) last[r["point_id"].get<std::string>()] = r;
  ASSERT_EQ(last.size(), 4u);
  const std::string base = "tinyllama-debug/T32/B3/f0.4/";
  for (const char* pid : {"loss_only/none", "collider/exact_query"}) {
    SCOPED_TRACE(pid);
    const auto& per_seq = last.at(base + pid);
    const auto& batch = last.at(base + pid + "/batch_topk");
    EXPECT_EQ(per_seq["selection"], "per_sequence");
    EXPECT_EQ(batch["selection"], "batch_topk");
    EXPECT_EQ(batch["status"], "ok");
    EXPECT_TRUE(std::isfinite(batch["val_loss"].get<double>()));
    // batch_topk drops ceil(0.4 x 96) = 39 of the batch's 3 x 32 tokens each step, over 8 steps.
    EXPECT_EQ(batch["tokens_backprop"].get<double>(), 8 * (3 * 32 - 39));
    // The logged step's rows: per_sequence keeps 32 - 16 in each (drop 12.8 rounded up to 16).
    EXPECT_EQ(per_seq["kept_per_row_min"], 16);
    EXPECT_EQ(per_seq["kept_per_row_max"], 16);
    EXPECT_NEAR(batch["kept_per_row_mean"].get<double>(), (3 * 32 - 39) / 3.0, 1e-9);
    EXPECT_LE(batch["kept_per_row_min"].get<int64_t>(), batch["kept_per_row_max"].get<int64_t>());
  }
  EXPECT_EQ(last.at(base + "loss_only/none/batch_topk")["tokens_backprop"],
            last.at(base + "collider/exact_query/batch_topk")["tokens_backprop"]);
}

TEST_F(Utility, ManifestErrorsNameTheKey) {
  testing::TempDir d("manifest");
  fsutil::write_file(d / "m.toml", "name = \"x\"\n[train]\nmodel = \"tinyllama-debug\"\nstepz = 3\n");
  EXPECT_TRUE(harness::is_training_manifest(d / "m.toml"));
  try {
    harness::load_train_manifest(d / "m.toml");
    FAIL() << "unknown key accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("train.stepz"), std::string::npos) << e.what();
  }
  fsutil::write_file(d / "ok.toml", "name = \"x\"\n[train]\nmodel = \"tinyllama-debug\"\n");
  const auto m = harness::load_train_manifest(d / "ok.toml", {"train.steps=7", "axes.filter_ratio=[0.4, 0.6]"});
  EXPECT_EQ(m.train.steps, 7);
  EXPECT_EQ(m.points.size(), 1u + 2u + 4u);  // regular, loss_only x 2 ratios, collider x 2 ratios x 2 semantics
  EXPECT_THROW(harness::load_train_manifest(d / "ok.toml", {"axes.filter_ratio=1.0"}), std::exception);
}

}  // namespace
}  // namespace collider
