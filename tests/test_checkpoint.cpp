// Tests of Hugging Face-layout checkpoints (models/hf_config.h, models/hf_tensors.h) and training
// checkpoints (models/checkpoint.h) on the -debug presets: save/load round trips are bit-exact
// (fp32 and bf16), bf16 files convert to fp32 exactly, shards load, tied heads are handled,
// config.json round-trips and rejects what we cannot run, and training resumes bit-identically
// from model + AdamW state.
// Run: OMP_NUM_THREADS=1 build/tests/test_checkpoint
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <ftw.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "base/fsutil.h"
#include "models/checkpoint.h"
#include "models/hf_config.h"
#include "models/hf_tensors.h"
#include "models/safetensors.h"

namespace cm = collider::models;
namespace fsu = collider::fsutil;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

const std::vector<std::string> kPresets = {"tinyllama-debug", "qwen2.5-debug", "phi-1.5-debug"};

// rm -rf through POSIX: libtorch.so exports a std::filesystem::remove_all that crashes.
void remove_tree(const std::string& p) {
  ::nftw(
      p.c_str(), [](const char* f, const struct stat*, int, struct FTW*) { return std::remove(f); }, 16,
      FTW_DEPTH | FTW_PHYS);
}

// A fresh temporary directory, removed at scope exit.
struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& name) {
    const char* tmp = std::getenv("TMPDIR");
    path = fs::path(tmp && *tmp ? tmp : "/tmp") / ("collider_ckpt_" + std::to_string(::getpid()) + "_" + name);
    remove_tree(path.string());
    if (::mkdir(path.c_str(), 0777) != 0) ADD_FAILURE() << "cannot create " << path;
  }
  ~TempDir() { remove_tree(path.string()); }
  std::string str() const { return path.string(); }
};

bool file_exists(const fs::path& p) { return ::access(p.c_str(), F_OK) == 0; }

bool bit_equal(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  auto ca = a.contiguous().cpu(), cb = b.contiguous().cpu();
  // Empty tensors may have no storage, and memcmp of a null pointer is undefined even for 0 bytes.
  return ca.nbytes() == 0 || std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.nbytes()) == 0;
}

// Every parameter of `a` is bit-equal to the one of the same name in `b`; returns the count.
int64_t expect_same_parameters(const torch::nn::Module& a, const torch::nn::Module& b) {
  auto pa = cm::parameter_tensors(a), pb = cm::parameter_tensors(b);
  EXPECT_EQ(pa.size(), pb.size());
  int64_t n = 0;
  for (const auto& [name, t] : pa) {
    auto it = pb.find(name);
    if (it == pb.end()) {
      ADD_FAILURE() << "missing " << name;
      continue;
    }
    EXPECT_TRUE(bit_equal(t, it->second)) << name << " differs";
    ++n;
  }
  return n;
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) { return e.what(); }
  return "";
}

}  // namespace

class CheckpointRoundTrip : public ::testing::TestWithParam<std::string> {};

TEST_P(CheckpointRoundTrip, SaveLoadIsBitExactAndKeepsTheConfig) {
  const cm::ModelConfig& cfg = cm::preset(GetParam());
  TempDir dir("rt_" + GetParam());
  cm::CausalLM model = cm::build_model(cfg, cm::AttentionImpl::kEager, /*seed=*/7);
  cm::save_hf_model(model, dir.str());
  EXPECT_TRUE(file_exists(dir.path / "config.json"));
  EXPECT_TRUE(file_exists(dir.path / "model.safetensors"));

  cm::CausalLM loaded = cm::load_hf_model(dir.str());
  EXPECT_EQ(loaded->config().name, cfg.name);
  EXPECT_EQ(loaded->config().num_params(), cfg.num_params());
  EXPECT_GT(expect_same_parameters(*model, *loaded), 0);
  // Not trivially equal: a model built from another seed differs.
  cm::CausalLM other = cm::build_model(cfg, cm::AttentionImpl::kEager, /*seed=*/8);
  EXPECT_FALSE(bit_equal(cm::parameter_tensors(*other).at("model.embed_tokens.weight"),
                         cm::parameter_tensors(*loaded).at("model.embed_tokens.weight")));

  // Same outputs, bit for bit.
  torch::NoGradGuard no_grad;
  torch::Tensor ids_BT = torch::randint(0, cfg.vocab_size, {2, 9}, torch::kInt64);
  EXPECT_TRUE(bit_equal(model->forward(ids_BT), loaded->forward(ids_BT)));

  // The tied head is not written (as transformers does).
  auto file = cm::SafetensorsFile::open((dir.path / "model.safetensors").string());
  EXPECT_EQ(file.contains("lm_head.weight"), !cfg.tie_embeddings);
  EXPECT_EQ(file.metadata().at("format"), "pt");
}

TEST_P(CheckpointRoundTrip, Bf16CheckpointsConvertExactly) {
  const cm::ModelConfig& cfg = cm::preset(GetParam());
  TempDir dir("bf16_" + GetParam());
  cm::CausalLM model = cm::build_model(cfg, cm::AttentionImpl::kEager, 3);
  model->to(torch::kBFloat16);
  cm::save_hf_model(model, dir.str());
  EXPECT_EQ(cm::SafetensorsFile::open((dir.path / "model.safetensors").string()).entries().front().dtype, "BF16");
  EXPECT_EQ(json::parse(std::ifstream(dir.path / "config.json"))["torch_dtype"], "bfloat16");

  cm::HfLoadOptions bf16;
  bf16.dtype = torch::kBFloat16;
  cm::CausalLM same = cm::load_hf_model(dir.str(), bf16);
  expect_same_parameters(*model, *same);

  cm::CausalLM fp32 = cm::load_hf_model(dir.str());  // default: fp32
  auto want = cm::parameter_tensors(*model);
  for (const auto& [name, t] : cm::parameter_tensors(*fp32)) {
    EXPECT_EQ(t.scalar_type(), torch::kFloat32) << name;
    EXPECT_TRUE(bit_equal(t, want.at(name).to(torch::kFloat32))) << name;
  }
}

INSTANTIATE_TEST_SUITE_P(Presets, CheckpointRoundTrip, ::testing::ValuesIn(kPresets),
                         [](const ::testing::TestParamInfo<std::string>& i) {
                           std::string s = i.param;
                           for (auto& c : s)
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           return s;
                         });

TEST(Checkpoint, ShardedCheckpointLoadsAndIndexErrorsAreCaught) {
  const cm::ModelConfig& cfg = cm::preset("tinyllama-debug");
  TempDir dir("sharded");
  cm::CausalLM model = cm::build_model(cfg, cm::AttentionImpl::kEager, 5);
  fsu::write_file_atomic((dir.path / "config.json").string(), cm::config_to_hf_json(cfg).dump(2));
  // Two shards: layer 0 and the rest.
  std::map<std::string, torch::Tensor> a, b;
  json weight_map;
  for (const auto& [name, t] : cm::parameter_tensors(*model)) {
    const bool first = name.rfind("model.layers.0.", 0) == 0;
    (first ? a : b)[name] = t;
    weight_map[name] = first ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  cm::save_safetensors((dir.path / "model-00001-of-00002.safetensors").string(), a);
  cm::save_safetensors((dir.path / "model-00002-of-00002.safetensors").string(), b);
  auto write_index = [&](const json& wm) {
    fsu::write_file_atomic((dir.path / "model.safetensors.index.json").string(),
                           json{{"metadata", {{"total_size", 0}}}, {"weight_map", wm}}.dump());
  };
  write_index(weight_map);
  cm::CausalLM loaded = cm::load_hf_model(dir.str());
  EXPECT_GT(expect_same_parameters(*model, *loaded), 0);

  json wrong = weight_map;
  wrong["model.norm.weight"] = "model-00001-of-00002.safetensors";
  write_index(wrong);
  EXPECT_NE(error_of([&] { cm::load_hf_model(dir.str()); }).find("does not hold it"), std::string::npos);

  json escape = weight_map;
  escape["model.norm.weight"] = "../elsewhere.safetensors";
  write_index(escape);
  EXPECT_NE(error_of([&] { cm::load_hf_model(dir.str()); }).find("must be a file in the same directory"),
            std::string::npos);

  json unlisted = weight_map;
  unlisted.erase("model.norm.weight");
  write_index(unlisted);
  EXPECT_NE(error_of([&] { cm::load_hf_model(dir.str()); }).find("does not place there"), std::string::npos);
}

TEST(Checkpoint, TiedHeadInTheFileMustEqualTheEmbedding) {
  const cm::ModelConfig& cfg = cm::preset("qwen2.5-debug");
  ASSERT_TRUE(cfg.tie_embeddings);
  TempDir dir("tied");
  cm::CausalLM model = cm::build_model(cfg, cm::AttentionImpl::kEager, 2);
  fsu::write_file_atomic((dir.path / "config.json").string(), cm::config_to_hf_json(cfg).dump(2));
  auto tensors = cm::parameter_tensors(*model);
  ASSERT_EQ(tensors.count("lm_head.weight"), 0u);
  // Some writers store the tied head explicitly: accepted when it equals the embedding.
  tensors["lm_head.weight"] = tensors.at("model.embed_tokens.weight").clone();
  cm::save_safetensors((dir.path / "model.safetensors").string(), tensors);
  cm::CausalLM loaded = cm::load_hf_model(dir.str());
  expect_same_parameters(*model, *loaded);

  tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1.0;
  cm::save_safetensors((dir.path / "model.safetensors").string(), tensors);
  const std::string msg = error_of([&] { cm::load_hf_model(dir.str()); });
  EXPECT_NE(msg.find("'lm_head.weight' differs from 'model.embed_tokens.weight'"), std::string::npos) << msg;
}

TEST(Checkpoint, MissingAndUnexpectedTensorsAreListedByName) {
  const cm::ModelConfig& cfg = cm::preset("phi-1.5-debug");
  TempDir dir("names");
  cm::CausalLM model = cm::build_model(cfg);
  fsu::write_file_atomic((dir.path / "config.json").string(), cm::config_to_hf_json(cfg).dump(2));
  auto tensors = cm::parameter_tensors(*model);
  tensors.erase("model.layers.1.mlp.fc2.bias");
  tensors.erase("lm_head.bias");
  tensors["model.layers.1.mlp.fc3.weight"] = torch::zeros({2});
  tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch::zeros({4});  // ignored
  cm::save_safetensors((dir.path / "model.safetensors").string(), tensors);
  const std::string msg = error_of([&] { cm::load_hf_model(dir.str()); });
  EXPECT_NE(msg.find("missing tensors (2): model.layers.1.mlp.fc2.bias, lm_head.bias"), std::string::npos) << msg;
  EXPECT_NE(msg.find("unexpected tensors (1): model.layers.1.mlp.fc3.weight"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("inv_freq"), std::string::npos) << msg;
}

TEST(Checkpoint, LoadWeightsIntoAModelOfOtherShapesIsAnError) {
  TempDir dir("shapes");
  cm::save_hf_model(cm::build_model(cm::preset("tinyllama-debug")), dir.str());
  cm::CausalLM other = cm::build_model(cm::preset("qwen2.5-debug"));
  const std::string msg = error_of([&] { cm::load_hf_weights(other, dir.str()); });
  EXPECT_NE(msg.find("does not have the shapes of model 'qwen2.5-debug'"), std::string::npos) << msg;
}

TEST(Checkpoint, MissingDirectoryOrFilesAreNamed) {
  EXPECT_NE(error_of([] { cm::load_hf_model("/nonexistent/ckpt"); }).find("/nonexistent/ckpt"), std::string::npos);
  TempDir dir("nofiles");
  fsu::write_file_atomic((dir.path / "config.json").string(),
                         cm::config_to_hf_json(cm::preset("tinyllama-debug")).dump());
  EXPECT_NE(error_of([&] { cm::load_hf_model(dir.str()); }).find("neither model.safetensors nor"), std::string::npos);
}

// ---- config.json -------------------------------------------------------------------------------

TEST(HfConfig, RoundTripsEveryPresetFamily) {
  for (const auto& name : kPresets) {
    const cm::ModelConfig& c = cm::preset(name);
    const cm::ModelConfig r = cm::config_from_hf_json(cm::config_to_hf_json(c), "roundtrip");
    EXPECT_EQ(r.name, c.name);
    EXPECT_EQ(r.family, c.family);
    EXPECT_EQ(r.vocab_size, c.vocab_size);
    EXPECT_EQ(r.hidden_size, c.hidden_size);
    EXPECT_EQ(r.intermediate_size, c.intermediate_size);
    EXPECT_EQ(r.num_layers, c.num_layers);
    EXPECT_EQ(r.num_heads, c.num_heads);
    EXPECT_EQ(r.num_kv_heads, c.num_kv_heads);
    EXPECT_EQ(r.head_dim, c.head_dim);
    EXPECT_EQ(r.norm_eps, c.norm_eps);
    EXPECT_EQ(r.rope_theta, c.rope_theta);
    EXPECT_EQ(r.partial_rotary_factor, c.partial_rotary_factor);
    EXPECT_EQ(r.max_position, c.max_position);
    EXPECT_EQ(r.qkv_bias, c.qkv_bias);
    EXPECT_EQ(r.linear_bias, c.linear_bias);
    EXPECT_EQ(r.tie_embeddings, c.tie_embeddings);
    EXPECT_EQ(r.lm_head_bias, c.lm_head_bias);
  }
}

// The published configs of the three paper models (transformers 4.x layout) map to our presets.
TEST(HfConfig, PaperModelConfigsMapToThePresets) {
  const json tinyllama = json::parse(R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "rope_scaling": null,
    "vocab_size": 32000, "tie_word_embeddings": false, "hidden_act": "silu", "max_position_embeddings": 2048,
    "pretraining_tp": 1, "torch_dtype": "bfloat16"})");
  const json qwen = json::parse(R"({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
    "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072,
    "use_sliding_window": false, "max_window_layers": 21, "vocab_size": 151936, "tie_word_embeddings": true,
    "hidden_act": "silu", "max_position_embeddings": 131072, "torch_dtype": "bfloat16"})");
  const json phi = json::parse(R"({"architectures": ["PhiForCausalLM"], "model_type": "phi",
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24, "num_attention_heads": 32,
    "num_key_value_heads": null, "layer_norm_eps": 1e-05, "partial_rotary_factor": 0.5, "rope_theta": 10000.0,
    "rope_scaling": null, "qk_layernorm": false, "hidden_act": "gelu_new", "vocab_size": 51200,
    "tie_word_embeddings": false, "max_position_embeddings": 2048, "torch_dtype": "float16"})");
  const std::vector<std::pair<json, std::string>> cases = {
      {tinyllama, "tinyllama-1.1b"}, {qwen, "qwen2.5-1.5b"}, {phi, "phi-1.5"}};
  for (const auto& [j, preset] : cases) {
    const cm::ModelConfig c = cm::config_from_hf_json(j, preset);
    const cm::ModelConfig& p = cm::preset(preset);
    EXPECT_EQ(c.num_params(), p.num_params()) << preset;
    EXPECT_EQ(c.num_kv_heads, p.num_kv_heads) << preset;
    EXPECT_EQ(c.norm_eps, p.norm_eps) << preset;
    EXPECT_EQ(c.rope_theta, p.rope_theta) << preset;
    EXPECT_EQ(c.partial_rotary_factor, p.partial_rotary_factor) << preset;
    EXPECT_EQ(c.tie_embeddings, p.tie_embeddings) << preset;
  }
}

TEST(HfConfig, RejectsWhatOurModelsCannotRun) {
  const json base = cm::config_to_hf_json(cm::preset("tinyllama-debug"));
  struct Case {
    std::function<void(json&)> edit;
    const char* marker;
  };
  const std::vector<Case> cases = {
      {[](json& j) { j["architectures"] = {"GPT2LMHeadModel"}; }, "'GPT2LMHeadModel'"},
      {[](json& j) {
         j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}};
       },
       "only the default RoPE"},
      {[](json& j) {
         j["rope_parameters"] = {{"rope_type", "yarn"}};
       },
       "only the default RoPE"},
      {[](json& j) { j["attention_bias"] = true; }, "'attention_bias' = true is not supported"},
      {[](json& j) { j["hidden_act"] = "gelu"; }, "hidden_act = 'gelu' is not supported"},
      {[](json& j) { j.erase("hidden_size"); }, "key 'hidden_size' is missing"},
      {[](json& j) { j["num_hidden_layers"] = -2; }, "'num_hidden_layers' must be a positive integer"},
      {[](json& j) { j["num_key_value_heads"] = 3; }, "not a multiple of num_key_value_heads 3"},
      {[](json& j) { j["head_dim"] = 7; }, "head_dim 7 differs"},
  };
  for (const auto& c : cases) {
    json j = base;
    c.edit(j);
    const std::string msg = error_of([&] { cm::config_from_hf_json(j, "bad.json"); });
    EXPECT_NE(msg.find(c.marker), std::string::npos) << "expected '" << c.marker << "', got '" << msg << "'";
    EXPECT_NE(msg.find("bad.json"), std::string::npos) << msg;
  }
  // transformers 5 layout: rope_parameters carries rope_theta and partial_rotary_factor.
  json phi = cm::config_to_hf_json(cm::preset("phi-1.5-debug"));
  phi.erase("rope_theta");
  phi.erase("partial_rotary_factor");
  phi["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 5000.0}, {"partial_rotary_factor", 0.25}};
  const cm::ModelConfig c = cm::config_from_hf_json(phi, "v5.json");
  EXPECT_EQ(c.rope_theta, 5000.0);
  EXPECT_EQ(c.partial_rotary_factor, 0.25);
}

// ---- training resume ---------------------------------------------------------------------------

namespace {

torch::Tensor train_steps(cm::CausalLM& model, torch::optim::AdamW& opt, int64_t first_step, int64_t num_steps) {
  const auto& cfg = model->config();
  torch::Tensor last;
  for (int64_t s = first_step; s < first_step + num_steps; ++s) {
    torch::manual_seed(1000 + s);  // the batch depends on the step only
    torch::Tensor ids_BT = torch::randint(0, cfg.vocab_size, {2, 12}, torch::kInt64);
    torch::Tensor labels_BT = torch::roll(ids_BT, -1, 1);
    opt.zero_grad();
    torch::Tensor loss = cm::token_losses(model->forward(ids_BT), labels_BT).mean();
    loss.backward();
    opt.step();
    last = loss.detach();
  }
  return last;
}

}  // namespace

TEST(TrainingCheckpoint, ResumeIsBitIdenticalToUninterruptedTraining) {
  at::set_num_threads(1);  // deterministic reductions
  for (const auto& name : kPresets) {
    SCOPED_TRACE(name);
    const cm::ModelConfig& cfg = cm::preset(name);
    TempDir dir("resume_" + std::to_string(&name - &kPresets[0]));
    auto adamw = [](cm::CausalLM& m) {
      return torch::optim::AdamW(m->parameters(), torch::optim::AdamWOptions(3e-3).weight_decay(0.1).amsgrad(true));
    };

    // Uninterrupted: 5 steps.
    cm::CausalLM ref = cm::build_model(cfg, cm::AttentionImpl::kEager, 11);
    auto ref_opt = adamw(ref);
    train_steps(ref, ref_opt, 0, 5);

    // Interrupted after 3 steps, saved, resumed in fresh objects built from another seed.
    cm::CausalLM a = cm::build_model(cfg, cm::AttentionImpl::kEager, 11);
    auto a_opt = adamw(a);
    train_steps(a, a_opt, 0, 3);
    // A scheduler's change of lr must be restored too (set back to 3e-3 after the check below).
    static_cast<torch::optim::AdamWOptions&>(a_opt.param_groups()[0].options()).lr(2e-3);
    cm::save_training_checkpoint(dir.str(), a, cm::adamw_state_tensors(a_opt, *a), json{{"step", 3}, {"seed", 11}});

    cm::CausalLM b = cm::build_model(cfg, cm::AttentionImpl::kEager, 99);
    auto b_opt = adamw(b);
    cm::TrainingState st = cm::load_training_checkpoint(dir.str(), b);
    EXPECT_EQ(st.trainer_state["step"], 3);
    cm::restore_adamw_state(b_opt, *b, st.optimizer_state);
    EXPECT_DOUBLE_EQ(static_cast<torch::optim::AdamWOptions&>(b_opt.param_groups()[0].options()).lr(), 2e-3);
    static_cast<torch::optim::AdamWOptions&>(b_opt.param_groups()[0].options()).lr(3e-3);
    expect_same_parameters(*a, *b);
    // Optimizer state tensors round-trip bit-exactly.
    auto saved = cm::adamw_state_tensors(a_opt, *a), restored = cm::adamw_state_tensors(b_opt, *b);
    ASSERT_EQ(saved.size(), restored.size());
    for (const auto& [k, t] : saved)
      if (k.find("lr") == std::string::npos) { EXPECT_TRUE(bit_equal(t, restored.at(k))) << k; }

    train_steps(b, b_opt, 3, 2);
    EXPECT_GT(expect_same_parameters(*ref, *b), 0);
  }
}

TEST(TrainingCheckpoint, IncompleteOrMismatchedStateIsAnError) {
  const cm::ModelConfig& cfg = cm::preset("tinyllama-debug");
  TempDir dir("incomplete");
  cm::CausalLM m = cm::build_model(cfg);
  cm::save_hf_model(m, dir.str());  // no trainer_state.json
  EXPECT_NE(error_of([&] { cm::load_training_checkpoint(dir.str(), m); }).find("has no trainer_state.json"),
            std::string::npos);

  torch::optim::AdamW opt(m->parameters(), torch::optim::AdamWOptions(1e-3));
  train_steps(m, opt, 0, 1);
  auto state = cm::adamw_state_tensors(opt, *m);
  auto extra = state;
  extra["state.model.bogus.exp_avg"] = torch::zeros({1});
  EXPECT_NE(
      error_of([&] { cm::restore_adamw_state(opt, *m, extra); }).find("unexpected tensors (1): state.model.bogus"),
      std::string::npos);
  auto lacking = state;
  lacking.erase("state.model.norm.weight.exp_avg_sq");
  EXPECT_NE(
      error_of([&] { cm::restore_adamw_state(opt, *m, lacking); }).find("lacks 'state.model.norm.weight.exp_avg_sq'"),
      std::string::npos);
}
