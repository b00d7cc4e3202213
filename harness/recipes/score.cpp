// `collider score` (see score.h): load a Hugging Face-layout checkpoint, read token ids, write the
// per-token losses as JSONL. Tests: tests/test_hf_agreement.cpp.
#include "harness/recipes/score.h"

#include "base/fsutil.h"

#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>

#include "models/hf_tensors.h"

namespace collider::harness {

namespace {

constexpr const char* kUsage =
    "usage: collider score --checkpoint DIR --tokens FILE [--out FILE]\n"
    "                      [--batch-size N] [--device cpu|cuda] [--dtype float32|bfloat16|float16]\n"
    "  Per-token losses (nats) of the Hugging Face-layout checkpoint DIR (config.json + safetensors)\n"
    "  over FILE (one sequence per line, space-separated token ids). Writes JSONL to FILE or stdout:\n"
    "  {\"seq\": i, \"losses\": [...]}, losses[t] = loss of predicting token t+1 from tokens 0..t.\n";

struct UsageError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

struct ScoreArgs {
  std::string checkpoint, tokens, out;
  int64_t batch_size = 8;
  std::string device = "cpu";
  std::string dtype = "float32";
};

ScoreArgs parse_args(const std::vector<std::string>& args_in) {
  std::vector<std::string> args = args_in;
  if (!args.empty() && args[0] == "score") args.erase(args.begin());
  ScoreArgs a;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string key = args[i], value;
    const auto eq = key.find('=');
    const bool inline_value = key.rfind("--", 0) == 0 && eq != std::string::npos;
    if (inline_value) {
      value = key.substr(eq + 1);
      key = key.substr(0, eq);
    }
    auto take = [&]() -> std::string {
      if (inline_value) return value;
      if (i + 1 >= args.size()) throw UsageError(fmt::format("option {} needs a value", key));
      return args[++i];
    };
    if (key == "--checkpoint") {
      a.checkpoint = take();
    } else if (key == "--tokens") {
      a.tokens = take();
    } else if (key == "--out") {
      a.out = take();
    } else if (key == "--device") {
      a.device = take();
    } else if (key == "--dtype") {
      a.dtype = take();
    } else if (key == "--batch-size") {
      const std::string v = take();
      int64_t n = 0;
      auto r = std::from_chars(v.data(), v.data() + v.size(), n);
      if (r.ec != std::errc() || r.ptr != v.data() + v.size() || n <= 0)
        throw UsageError(fmt::format("--batch-size must be a positive integer, got '{}'", v));
      a.batch_size = n;
    } else {
      throw UsageError(fmt::format("unknown argument '{}'", args[i]));
    }
  }
  if (a.checkpoint.empty()) throw UsageError("--checkpoint DIR is required");
  if (a.tokens.empty()) throw UsageError("--tokens FILE is required");
  return a;
}

torch::ScalarType parse_dtype(const std::string& s) {
  if (s == "float32" || s == "fp32") return torch::kFloat32;
  if (s == "bfloat16" || s == "bf16") return torch::kBFloat16;
  if (s == "float16" || s == "fp16") return torch::kFloat16;
  throw UsageError(fmt::format("--dtype '{}' is not one of float32, bfloat16, float16", s));
}

}  // namespace

std::vector<std::vector<int64_t>> read_token_file(const std::string& path, int64_t vocab_size) {
  std::ifstream f(path);
  if (!f) throw std::runtime_error(fmt::format("tokens file '{}' cannot be opened (does it exist?)", path));
  std::vector<std::vector<int64_t>> seqs;
  std::string line;
  int64_t line_no = 0;
  while (std::getline(f, line)) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    std::istringstream words(line);
    std::vector<int64_t> seq;
    std::string w;
    while (words >> w) {
      int64_t id = 0;
      auto r = std::from_chars(w.data(), w.data() + w.size(), id);
      if (r.ec != std::errc() || r.ptr != w.data() + w.size())
        throw std::runtime_error(
            fmt::format("tokens file '{}' line {}: '{}' is not an integer token id", path, line_no, w));
      if (id < 0 || id >= vocab_size)
        throw std::runtime_error(
            fmt::format("tokens file '{}' line {}: token id {} is outside the vocabulary "
                        "[0, {}) of the checkpoint",
                        path, line_no, id, vocab_size));
      seq.push_back(id);
    }
    if (seq.empty())
      throw std::runtime_error(
          fmt::format("tokens file '{}' line {} is empty (each line is one sequence of at "
                      "least one token id)",
                      path, line_no));
    seqs.push_back(std::move(seq));
  }
  if (f.bad()) throw std::runtime_error(fmt::format("tokens file '{}': read error", path));
  return seqs;
}

std::vector<std::vector<float>> score_sequences(models::CausalLM& model,
                                                const std::vector<std::vector<int64_t>>& sequences,
                                                int64_t batch_size) {
  TORCH_CHECK(batch_size > 0, "score_sequences: batch_size must be positive, got ", batch_size);
  model->eval();
  torch::NoGradGuard no_grad;
  const auto& cfg = model->config();
  torch::Device device = torch::kCPU;
  for (const auto& p : model->parameters()) {
    device = p.device();
    break;
  }
  std::vector<std::vector<float>> out(sequences.size());
  size_t i = 0;
  while (i < sequences.size()) {
    const int64_t T = static_cast<int64_t>(sequences[i].size());
    if (T > cfg.max_position)
      throw std::runtime_error(
          fmt::format("sequence {} has {} tokens, more than the model's max_position_embeddings "
                      "{}",
                      i, T, cfg.max_position));
    size_t j = i;
    while (j < sequences.size() && static_cast<int64_t>(sequences[j].size()) == T &&
           static_cast<int64_t>(j - i) < batch_size)
      ++j;
    if (T < 2) {  // nothing to predict
      i = j;
      continue;
    }
    const int64_t B = static_cast<int64_t>(j - i);
    torch::Tensor ids_BT = torch::empty({B, T}, torch::kInt64);
    for (int64_t b = 0; b < B; ++b)
      std::copy(sequences[i + b].begin(), sequences[i + b].end(), ids_BT[b].data_ptr<int64_t>());
    ids_BT = ids_BT.to(device);
    torch::Tensor logits_BTV = model->forward(ids_BT).to(torch::kFloat32);
    torch::Tensor loss_BT =
        models::token_losses(logits_BTV.slice(1, 0, T - 1), ids_BT.slice(1, 1, T).contiguous());  // [B, T-1]
    loss_BT = loss_BT.to(torch::kCPU, torch::kFloat32).contiguous();
    for (int64_t b = 0; b < B; ++b) {
      const float* row = loss_BT[b].data_ptr<float>();
      for (int64_t t = 0; t < T - 1; ++t)
        if (!std::isfinite(row[t]))
          throw std::runtime_error(
              fmt::format("sequence {} position {}: the loss is not finite ({}); the "
                          "checkpoint's weights or the dtype overflow",
                          i + b, t, row[t]));
      out[i + b].assign(row, row + (T - 1));
    }
    i = j;
  }
  return out;
}

std::string score_json_line(int64_t seq, const std::vector<float>& losses) {
  std::string s = fmt::format("{{\"seq\": {}, \"losses\": [", seq);
  for (size_t t = 0; t < losses.size(); ++t) s += (t ? ", " : "") + fmt::format("{}", losses[t]);
  s += "]}";
  return s;
}

int run_score(const std::vector<std::string>& args) {
  ScoreArgs a;
  torch::ScalarType dtype;
  torch::Device device = torch::kCPU;
  try {
    for (const auto& w : args)
      if (w == "--help" || w == "-h") {
        std::fputs(kUsage, stdout);
        return 0;
      }
    a = parse_args(args);
    dtype = parse_dtype(a.dtype);
    try {
      device = torch::Device(a.device);
    } catch (const c10::Error&) {
      throw UsageError(fmt::format("--device '{}' is not a device (cpu, cuda, cuda:N)", a.device));
    }
  } catch (const UsageError& e) {
    std::fprintf(stderr, "collider score: %s\n%s", e.what(), kUsage);
    return 2;
  }
  try {
    models::HfLoadOptions opts;
    opts.dtype = dtype;
    opts.device = device;
    if (opts.device.is_cuda() && !torch::cuda::is_available())
      throw std::runtime_error("--device cuda was given but no CUDA device is available");
    models::CausalLM model = models::load_hf_model(a.checkpoint, opts);
    const auto seqs = read_token_file(a.tokens, model->config().vocab_size);
    const auto losses = score_sequences(model, seqs, a.batch_size);
    std::string text;
    for (size_t i = 0; i < losses.size(); ++i) text += score_json_line(static_cast<int64_t>(i), losses[i]) + "\n";
    if (a.out.empty()) {
      std::fwrite(text.data(), 1, text.size(), stdout);
      std::fflush(stdout);
    } else {
      fsutil::write_file_atomic(a.out, text);
      std::fprintf(stderr, "collider score: %zu sequences scored with %s (%s) -> %s\n", losses.size(),
                   a.checkpoint.c_str(), model->config().name.c_str(), a.out.c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "collider score: error: %s\n", e.what());
    return 1;
  }
  return 0;
}

}  // namespace collider::harness
