// Agreement with the reference implementations: tiny random LlamaForCausalLM, Qwen2ForCausalLM
// (tied, written in shards) and PhiForCausalLM (partial rotary) checkpoints written by Hugging Face
// transformers (scripts/make_hf_fixtures.py, committed under tests/fixtures/hf/) load through our
// reader into our models and give transformers' logits (max abs diff <= 1e-4, fp32) and per-token
// losses; `collider score` prints the same losses. Also the score command's error cases.
// Run: OMP_NUM_THREADS=1 build/tests/test_hf_agreement
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "harness/recipes/score.h"
#include "models/hf_tensors.h"
#include "models/safetensors.h"

namespace cm = collider::models;
namespace ch = collider::harness;
using nlohmann::json;

namespace {

const std::string kFixtures = std::string(COLLIDER_SOURCE_DIR) + "/tests/fixtures/hf";
constexpr double kLogitTol = 1e-4;  // fp32; the issue's bound
constexpr double kLossTol = 1e-4;

struct Expected {
  torch::Tensor input_ids_BT;  // int64 [B, T]
  torch::Tensor logits_BTV;    // float [B, T, V]
  torch::Tensor losses_BT1;    // float [B, T-1]
};

Expected read_expected(const std::string& family) {
  auto f = cm::SafetensorsFile::open(kFixtures + "/" + family + "/expected.safetensors");
  return {f.tensor("input_ids"), f.tensor("logits"), f.tensor("losses")};
}

// (std::filesystem's free functions are avoided: libtorch.so exports copies, some of them broken.)
std::string temp_path(const std::string& name) {
  const char* tmp = std::getenv("TMPDIR");
  return std::string(tmp && *tmp ? tmp : "/tmp") + "/collider_hf_" + std::to_string(::getpid()) + "_" + name;
}

// Runs `collider score` and returns (exit code, stderr text).
std::pair<int, std::string> run_score_capturing(const std::vector<std::string>& args) {
  testing::internal::CaptureStderr();
  int rc = ch::run_score(args);
  return {rc, testing::internal::GetCapturedStderr()};
}

}  // namespace

class HfAgreement : public ::testing::TestWithParam<std::string> {};

TEST_P(HfAgreement, LogitsAndLossesMatchTransformers) {
  const std::string family = GetParam();
  const Expected ex = read_expected(family);
  cm::CausalLM model = cm::load_hf_model(kFixtures + "/" + family);
  model->eval();
  ASSERT_EQ(model->config().vocab_size, ex.logits_BTV.size(2));

  for (auto impl : {cm::AttentionImpl::kEager, cm::AttentionImpl::kSdpa}) {
    SCOPED_TRACE(impl == cm::AttentionImpl::kEager ? "eager attention" : "sdpa attention");
    model->set_attention_impl(impl);
    torch::NoGradGuard no_grad;
    torch::Tensor logits_BTV = model->forward(ex.input_ids_BT).to(torch::kFloat32);
    ASSERT_EQ(logits_BTV.sizes(), ex.logits_BTV.sizes());
    const double max_diff = (logits_BTV - ex.logits_BTV).abs().max().item<double>();
    EXPECT_LE(max_diff, kLogitTol) << family << ": max |logits - transformers' logits| = " << max_diff;
    std::printf("%s %s: max |logits - transformers| = %.3g\n", family.c_str(),
                cm::to_string(impl), max_diff);
    // The check is not vacuous: the logits are O(1) and differ across positions.
    EXPECT_GT(ex.logits_BTV.std().item<double>(), 0.3);

    const int64_t T = ex.input_ids_BT.size(1);
    torch::Tensor loss_BT1 =
        cm::token_losses(logits_BTV.slice(1, 0, T - 1), ex.input_ids_BT.slice(1, 1, T).contiguous());
    const double loss_diff = (loss_BT1 - ex.losses_BT1).abs().max().item<double>();
    EXPECT_LE(loss_diff, kLossTol) << family << ": max |loss - transformers' loss| = " << loss_diff;
  }
}

// The fixture layout we rely on: qwen2 is tied and sharded, phi rotates half of each head.
TEST_P(HfAgreement, FixtureConfigMapsToOurConfig) {
  const std::string family = GetParam();
  const cm::ModelConfig cfg = cm::read_hf_config(kFixtures + "/" + family);
  EXPECT_EQ(cfg.hidden_size, 64);
  EXPECT_EQ(cfg.num_layers, 2);
  EXPECT_EQ(cfg.head_dim, 16);
  if (family == "qwen2") {
    EXPECT_EQ(cfg.family, cm::Family::kQwen2);
    EXPECT_TRUE(cfg.tie_embeddings);
    EXPECT_TRUE(cfg.qkv_bias);
    EXPECT_EQ(cfg.num_kv_heads, 1);
    EXPECT_DOUBLE_EQ(cfg.rope_theta, 1e6);
    EXPECT_GT(cm::HfCheckpoint(kFixtures + "/qwen2").num_files(), 1u) << "the qwen2 fixture should be sharded";
  } else if (family == "phi") {
    EXPECT_EQ(cfg.family, cm::Family::kPhi);
    EXPECT_DOUBLE_EQ(cfg.partial_rotary_factor, 0.5);
    EXPECT_TRUE(cfg.linear_bias);
    EXPECT_TRUE(cfg.lm_head_bias);
    EXPECT_EQ(cfg.qkv_bias, cm::preset("phi-1.5-debug").qkv_bias);
  } else {
    EXPECT_EQ(cfg.family, cm::Family::kLlama);
    EXPECT_EQ(cfg.num_kv_heads, 2);
    EXPECT_FALSE(cfg.tie_embeddings);
  }
  // The analytic parameter count agrees with the checkpoint's tensors.
  cm::HfCheckpoint ck(kFixtures + "/" + family);
  int64_t n = 0;
  for (const auto& name : ck.names()) {
    int64_t numel = 1;
    for (int64_t d : ck.entry(name).shape) numel *= d;
    n += numel;
  }
  EXPECT_EQ(cfg.num_params(), n);
}

// `collider score` on the fixture's tokens.txt prints transformers' per-token losses.
TEST_P(HfAgreement, ScoreCommandPrintsTransformersLosses) {
  const std::string family = GetParam();
  const std::string out = temp_path(family + "_scores.jsonl");
  auto [rc, err] = run_score_capturing({"score", "--checkpoint", kFixtures + "/" + family, "--tokens",
                                        kFixtures + "/" + family + "/tokens.txt", "--out", out, "--batch-size", "1"});
  ASSERT_EQ(rc, 0) << err;
  std::ifstream got(out), want(kFixtures + "/" + family + "/expected_scores.jsonl");
  std::string gl, wl;
  int64_t lines = 0;
  while (std::getline(want, wl)) {
    ASSERT_TRUE(static_cast<bool>(std::getline(got, gl))) << "score output has fewer lines than expected";
    json g = json::parse(gl), w = json::parse(wl);
    EXPECT_EQ(g["seq"], w["seq"]);
    ASSERT_EQ(g["losses"].size(), 15u);
    ASSERT_EQ(g["losses"].size(), w["losses"].size());
    for (size_t t = 0; t < w["losses"].size(); ++t)
      EXPECT_NEAR(g["losses"][t].get<double>(), w["losses"][t].get<double>(), kLossTol)
          << "seq " << lines << " t " << t;
    ++lines;
  }
  EXPECT_EQ(lines, 2);
  EXPECT_FALSE(static_cast<bool>(std::getline(got, gl))) << "score output has extra lines";
  std::remove(out.c_str());
}

INSTANTIATE_TEST_SUITE_P(Families, HfAgreement, ::testing::Values("llama", "qwen2", "phi"));

TEST(Score, VariableLengthSequencesAndBatchingGiveTheSameLosses) {
  cm::CausalLM model = cm::load_hf_model(kFixtures + "/llama");
  const Expected ex = read_expected("llama");
  std::vector<std::vector<int64_t>> seqs;
  for (int64_t b = 0; b < 2; ++b) {
    auto row = ex.input_ids_BT[b].contiguous();
    seqs.emplace_back(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + row.numel());
  }
  seqs.push_back({5});                                                         // one token: no loss
  seqs.push_back(std::vector<int64_t>(seqs[0].begin(), seqs[0].begin() + 7));  // a prefix
  auto batched = ch::score_sequences(model, seqs, 8);
  auto single = ch::score_sequences(model, seqs, 1);
  ASSERT_EQ(batched.size(), 4u);
  EXPECT_TRUE(batched[2].empty());
  ASSERT_EQ(batched[3].size(), 6u);
  for (size_t t = 0; t < 6; ++t) {
    // Causality: a prefix's losses equal the full sequence's first losses.
    EXPECT_NEAR(batched[3][t], batched[0][t], 1e-5);
    EXPECT_NEAR(batched[0][t], ex.losses_BT1[0][t].item<float>(), kLossTol);
  }
  for (size_t i = 0; i < seqs.size(); ++i)
    for (size_t t = 0; t < batched[i].size(); ++t) EXPECT_NEAR(batched[i][t], single[i][t], 1e-5);
  EXPECT_EQ(ch::score_json_line(3, {1.5f, 0.25f}), R"({"seq": 3, "losses": [1.5, 0.25]})");
}

TEST(Score, ErrorsNameTheProblem) {
  const std::string ckpt = kFixtures + "/llama";
  const std::string tokens = temp_path("bad_tokens.txt");
  auto write = [&](const std::string& text) { std::ofstream(tokens) << text; };

  auto [rc1, e1] = run_score_capturing({"--checkpoint", ckpt, "--tokens", "/nonexistent/tokens.txt"});
  EXPECT_EQ(rc1, 1);
  EXPECT_NE(e1.find("'/nonexistent/tokens.txt' cannot be opened"), std::string::npos) << e1;

  write("1 2 3\n4 five 6\n");
  auto [rc2, e2] = run_score_capturing({"--checkpoint", ckpt, "--tokens", tokens});
  EXPECT_EQ(rc2, 1);
  EXPECT_NE(e2.find("line 2: 'five' is not an integer token id"), std::string::npos) << e2;

  write("1 2 3\n4 128 6\n");  // the fixture's vocabulary is 128
  auto [rc3, e3] = run_score_capturing({"--checkpoint", ckpt, "--tokens", tokens});
  EXPECT_EQ(rc3, 1);
  EXPECT_NE(e3.find("line 2: token id 128 is outside the vocabulary [0, 128)"), std::string::npos) << e3;

  write("1 2 3\n-1 2\n");
  auto [rc4, e4] = run_score_capturing({"--checkpoint", ckpt, "--tokens", tokens});
  EXPECT_EQ(rc4, 1);
  EXPECT_NE(e4.find("token id -1 is outside the vocabulary"), std::string::npos) << e4;

  write("1 2 3\n\n4 5\n");
  auto [rc5, e5] = run_score_capturing({"--checkpoint", ckpt, "--tokens", tokens});
  EXPECT_EQ(rc5, 1);
  EXPECT_NE(e5.find("line 2 is empty"), std::string::npos) << e5;

  auto [rc6, e6] = run_score_capturing({"--checkpoint", "/nonexistent/ckpt", "--tokens", tokens});
  EXPECT_EQ(rc6, 1);
  EXPECT_NE(e6.find("/nonexistent/ckpt"), std::string::npos) << e6;

  auto [rc7, e7] = run_score_capturing({"--tokens", tokens});
  EXPECT_EQ(rc7, 2);
  EXPECT_NE(e7.find("--checkpoint DIR is required"), std::string::npos) << e7;

  auto [rc8, e8] = run_score_capturing({"--checkpoint", ckpt, "--tokens", tokens, "--frobnicate"});
  EXPECT_EQ(rc8, 2);
  EXPECT_NE(e8.find("unknown argument '--frobnicate'"), std::string::npos) << e8;

  std::string long_line;
  for (int i = 0; i < 65; ++i) long_line += "1 ";  // 65 tokens exceed max_position_embeddings 64
  write(long_line + "\n");
  auto [rc9, e9] = run_score_capturing({"--checkpoint", ckpt, "--tokens", tokens});
  EXPECT_EQ(rc9, 1);
  EXPECT_NE(e9.find("more than the model's max_position_embeddings 64"), std::string::npos) << e9;
  std::remove(tokens.c_str());
}
