// Collider's backward vs regular and loss_only, measured side by side in one process (the
// backward benchmark of results/README.md). For each model and T: regular, loss_only, collider
// kept_only, collider exact_query and the T' floor (regular on a batch of T' = N tokens): --warmup
// steps of each in turn, then --reps rounds in the measurement engine's serpentine order
// (base/rounds.h), so machine drift hits all methods alike; medians are reported
// with the FLOP ideal (models/flops.h: flop_ideal_reduction), the rewrite overhead and the
// live-tensor peak; the JSON rows carry the run's provenance as the sweeps' rows do.
// bwd_ms is loss.backward() alone (it includes cutting the saved tensors, which happens when the
// backward reads them); collider's reduction and "vs floor" count bwd_ms + rewrite_ms; rewrite% is
// rewrite_ms / collider's bwd_ms, rw/reg% rewrite_ms / regular's bwd_ms; peak_MiB the step's live
// tensors at their most (forward, rewrite and backward). Below each table: the saved tensors the
// rewrite cuts (count, bytes) and a plain cold copy of the same bytes;
// with --selection batch_topk, each ragged variant against per-sequence round by round. The CPU allocator caches freed blocks like CUDA's (collider_core/src/memory.h;
// COLLIDER_CPU_CACHING=0 for glibc's behaviour): the allocator mode is printed in the header.
// Its default 8 GiB holds every method's blocks at batch 1; at batch 4, T = 1024, the seven
// methods' blocks need more (COLLIDER_CPU_CACHE_MIB=16384), or the last ones of each round
// page-fault their gathers in.
//   build/bench/bm_collider_backward [--models tinyllama-mini,qwen2.5-mini,phi-1.5-mini]
//       [--seq 512,1024] [--ratio 0.4] [--batch 1] [--reps 7] [--warmup 2] [--json FILE]
//       [--device cpu|cuda] [--bf16]
//       [--selection batch_topk --data DIR --ref-losses FILE]   ragged kept counts (RHO-1)
// --selection batch_topk: the batch is real text (DIR/mix_train.bin of scripts/prepare_data.sh)
// scored by excess loss against stored reference losses (the *.reflosses.f32 file the utility
// experiment's reference stage writes under DIR/reference/); Collider then runs with the ragged batch_topk mask and
// with per-sequence masks of the same total kept count, interleaved with the rest; each ragged
// point is reported against its own FLOP ideal (counted row by row on the actual counts).
// CPU timings are relative figures only (DESIGN.md section 7); absolute times count on a GPU
// (there: --device cuda --bf16, timed with device synchronisation around each backward).
#include "base/stats.h"
#include "collider_core/src/memory.h"
#include "harness/measure/probes.h"
#include "base/rounds.h"
#include "harness/run/results.h"
#include "harness/components/token_data.h"
#include "harness/components/train_step.h"
#include "models/flops.h"
#include "models/method.h"
#include "models/model.h"

#include <collider/collider.h>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace {

using collider::AttentionGrad;
using collider::SelectPolicy;
using collider::models::Method;
using collider::models::MethodSpec;
using Clock = std::chrono::steady_clock;

struct Options {
  std::vector<std::string> models = {"tinyllama-mini", "qwen2.5-mini", "phi-1.5-mini"};
  std::vector<int64_t> seqs = {512, 1024};
  double ratio = 0.4;
  int64_t batch = 1;
  int reps = 7, warmup = 2;
  std::string json;
  std::string device = "cpu";
  bool bf16 = false;
  SelectPolicy selection = SelectPolicy::kPerSequence;  // or batch_topk (needs data)
  std::string data, ref_losses;
};

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(item);
  return out;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    if (a == "--models")
      o.models = split(next());
    else if (a == "--seq") {
      o.seqs.clear();
      for (auto& s : split(next())) o.seqs.push_back(std::stoll(s));
    } else if (a == "--ratio")
      o.ratio = std::stod(next());
    else if (a == "--batch")
      o.batch = std::stoll(next());
    else if (a == "--reps")
      o.reps = std::stoi(next());
    else if (a == "--warmup")
      o.warmup = std::stoi(next());
    else if (a == "--json")
      o.json = next();
    else if (a == "--device")
      o.device = next();
    else if (a == "--bf16")
      o.bf16 = true;
    else if (a == "--selection") {
      const std::string v = next();
      try {
        o.selection = collider::select_policy_from_string(v);
      } catch (const std::invalid_argument&) {
        throw std::invalid_argument("--selection must be per_sequence or batch_topk, got " + v);
      }
    } else if (a == "--data")
      o.data = next();
    else if (a == "--ref-losses")
      o.ref_losses = next();
    else
      throw std::invalid_argument("unknown option " + a + " (see the header of bench/bm_collider_backward.cpp)");
  }
  if (o.selection == SelectPolicy::kBatchTopK && (o.data.empty() || o.ref_losses.empty())) {
    throw std::invalid_argument(
        "--selection batch_topk needs --data DIR (scripts/prepare_data.sh's output) and "
        "--ref-losses FILE (a *.reflosses.f32 of the utility experiment's reference stage)");
  }
  return o;
}

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

struct Sample {
  double bwd_ms = 0, rewrite_ms = 0, gather_ms = 0;  // gather_ms: the rewrite's copies of saved tensors
  int64_t peak_bytes = 0, gathered_bytes = 0, tensors_gathered = 0;
};

// What the rounds of one variant add up to: a Series (base/rounds.h) per time, with
// each round's median, the largest peak and the rewrite's gathered tensors.
struct Measured {
  collider::stats::Series bwd_ms, rewrite_ms, gather_ms, copy_ms;  // copy_ms: cold_copy_ms of the gathered bytes
  int64_t peak_bytes = 0, gathered_bytes = 0, tensors_gathered = 0;
  void add(const Sample& s, double copy) {
    bwd_ms.add(s.bwd_ms), rewrite_ms.add(s.rewrite_ms), gather_ms.add(s.gather_ms), copy_ms.add(copy);
    bwd_ms.end_round(), rewrite_ms.end_round(), gather_ms.end_round(), copy_ms.end_round();
    peak_bytes = std::max(peak_bytes, s.peak_bytes);
    gathered_bytes = s.gathered_bytes, tensors_gathered = s.tensors_gathered;
  }
};

// One measured variant: a method (MethodSpec: method, attention_grad, selection policy) or the
// T' floor (regular on the first T' tokens). Ragged variants are collider on the batch_topk mask.
struct Kind {
  const char* name;  // the table's and the JSON rows' "method"
  MethodSpec spec;
  bool floor = false;
  bool is_collider() const { return spec.method == Method::kCollider; }
  bool ragged() const { return spec.policy == SelectPolicy::kBatchTopK; }
};
const Kind kRegular{"regular", {Method::kRegular}};
const Kind kLossOnly{"loss_only", {Method::kLossOnly}};
const Kind kKeptOnly{"collider kept_only", {Method::kCollider, AttentionGrad::kKeptOnly}};
const Kind kExactQuery{"collider exact_query", {Method::kCollider, AttentionGrad::kExactQuery}};
const Kind kFloor{"floor (regular at T')", {Method::kRegular}, /*floor=*/true};
const Kind kRaggedKeptOnly{"ragged kept_only", {Method::kCollider, AttentionGrad::kKeptOnly, SelectPolicy::kBatchTopK}};
const Kind kRaggedExactQuery{"ragged exact_query",
                             {Method::kCollider, AttentionGrad::kExactQuery, SelectPolicy::kBatchTopK}};

// One forward + (rewrite) + backward; times the backward alone.
void sync(const torch::Tensor& t) {
  if (t.is_cuda()) torch::cuda::synchronize();
}

Sample run_once(collider::models::CausalLM& m, const collider::Plan& plan, const Kind& kind, const torch::Tensor& idx,
                const torch::Tensor& labels, const torch::Tensor& keep, collider::memory::MemoryProbe& mem,
                bool bf16) {
  for (auto& p : m->parameters()) p.mutable_grad() = torch::Tensor();
  sync(idx);
  mem.reset_peak();
  Sample s;
  torch::Tensor loss_BT;
  {
    collider::harness::AutocastScope autocast(bf16);
    loss_BT = collider::models::token_losses(m->forward(idx), labels);
  }
  const bool dense_keep = kind.spec.method == Method::kRegular;
  auto loss = collider::models::masked_mean_loss(loss_BT, dense_keep ? torch::ones_like(keep) : keep);
  if (kind.is_collider()) {
    collider::FilterOptions opts;
    opts.attention = kind.spec.attention_grad;
    sync(idx);
    auto t0 = Clock::now();
    const auto stats = collider::filter_backward(loss, keep, plan, opts);
    sync(idx);
    s.rewrite_ms = ms_since(t0);
    s.gather_ms = stats.gather_ms;
    s.gathered_bytes = stats.bytes_gathered;
    s.tensors_gathered = stats.tensors_gathered;
  }
  sync(idx);
  auto t0 = Clock::now();
  loss.backward();
  sync(idx);
  s.bwd_ms = ms_since(t0);
  s.peak_bytes = mem.peak_bytes();
  return s;
}

// The first B windows of T tokens of the prepared training mixture, with the reference model's
// per-token losses (stored per window of the utility experiment's length; consecutive windows
// are consecutive positions, so T a multiple of it reads several in a row).
collider::harness::Batch real_batch(const std::string& dir, const std::string& ref_path, int64_t B, int64_t T,
                                    int64_t vocab) {
  auto shard = std::make_shared<collider::harness::TokenShard>(dir + "/mix_train.bin");
  collider::harness::RefLosses ref(ref_path);
  if (ref.num_windows() * ref.seq_len() < B * T) {
    throw std::invalid_argument("the reference losses cover " + std::to_string(ref.num_windows()) + " windows of " +
                                std::to_string(ref.seq_len()) + ", fewer than B x T = " + std::to_string(B * T) +
                                " positions");
  }
  const int64_t Tr = ref.seq_len();
  if (T % Tr != 0) {
    throw std::invalid_argument("--seq " + std::to_string(T) + " must be a multiple of the reference losses' window " +
                                std::to_string(Tr));
  }
  if (static_cast<int64_t>(shard->header().vocab_size) > vocab) {
    throw std::invalid_argument("the data's vocabulary (" + std::to_string(shard->header().vocab_size) +
                                ") is larger than the model's (" + std::to_string(vocab) + ")");
  }
  collider::harness::Batch b;
  std::vector<torch::Tensor> ids, refs;
  for (int64_t r = 0; r < B; ++r) {
    ids.push_back(shard->slice(r * T, T + 1));
    std::vector<int64_t> w;
    for (int64_t j = 0; j < T / Tr; ++j) w.push_back(r * (T / Tr) + j);
    refs.push_back(ref.rows(w).reshape({T}));
  }
  auto all = torch::stack(ids);
  b.input_ids_BT = all.narrow(1, 0, T).contiguous();
  b.labels_BT = all.narrow(1, 1, T).contiguous();
  b.ref_loss_BT = torch::stack(refs);
  return b;
}

// The batch of one (model, T) point: random tokens with a per-sequence keep mask, or, with
// --selection batch_topk, real text with both masks from its excess losses (per_sequence at the
// same total kept count, and the ragged batch_topk one with its per-row counts).
struct PointBatch {
  torch::Tensor idx, labels, keep, keep_ragged;  // keep_ragged: undefined unless batch_topk
  int64_t N = 0;                                 // kept per row under per_sequence: T'
  std::vector<int64_t> ragged_rows;              // batch_topk's kept count per row
  torch::Tensor idx_N, labels_N, keep_N;         // the T' floor's batch: the first T' positions
};

PointBatch point_batch(const Options& o, const collider::models::ModelConfig& cfg, collider::models::CausalLM& m,
                       int64_t T, const torch::Device& dev) {
  PointBatch pb;
  torch::manual_seed(0);
  pb.idx = torch::randint(cfg.vocab_size, {o.batch, T}).to(dev);
  pb.labels = torch::randint(cfg.vocab_size, {o.batch, T}).to(dev);
  pb.keep = collider::select_tokens(torch::rand({o.batch, T}), o.ratio).to(dev);
  if (o.selection == SelectPolicy::kBatchTopK) {
    auto real = real_batch(o.data, o.ref_losses, o.batch, T, cfg.vocab_size);
    pb.idx = real.input_ids_BT.to(dev);
    pb.labels = real.labels_BT.to(dev);
    torch::Tensor model_loss_BT;
    {
      torch::NoGradGuard no_grad;
      model_loss_BT = collider::models::token_losses(m->forward(pb.idx), pb.labels).cpu();
    }
    auto excess_BT = collider::excess_loss(model_loss_BT, *real.ref_loss_BT);
    collider::SelectOptions per_row, batch;
    per_row.align = 1;  // the same total kept count as batch_topk (no rounding to 8)
    batch.policy = collider::SelectPolicy::kBatchTopK;
    pb.keep = collider::select_tokens(excess_BT, o.ratio, per_row).to(dev);
    pb.keep_ragged = collider::select_tokens(excess_BT, o.ratio, batch).to(dev);
    auto c = pb.keep_ragged.sum(1).cpu();
    pb.ragged_rows.assign(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
  }
  pb.N = pb.keep.sum(1)[0].item<int64_t>();
  pb.idx_N = pb.idx.narrow(1, 0, pb.N);
  pb.labels_N = pb.labels.narrow(1, 0, pb.N);
  pb.keep_N = torch::ones({o.batch, pb.N}, pb.keep.options());
  return pb;
}

// One point measured: its variants and what their rounds added up to (by Kind::name).
struct PointSamples {
  std::string model;
  const collider::models::ModelConfig* cfg;
  int64_t T;
  std::vector<Kind> kinds;
  std::map<std::string, Measured> samples;
  double median(const Kind& k, collider::stats::Series Measured::*f) { return (samples[k.name].*f).median(); }
};

// The FLOP ideal of a collider variant (models/flops.h); ragged rows: on the actual counts.
double ideal_of(const Options& o, const PointSamples& ps, const PointBatch& pb, const Kind& k) {
  if (!k.is_collider()) return 0.0;
  if (k.ragged() && pb.ragged_rows.empty()) return 0.0;
  return collider::models::flop_ideal_reduction(
      *ps.cfg, ps.T, k.ragged() ? pb.ragged_rows : std::vector<int64_t>(static_cast<size_t>(o.batch), pb.N), k.spec);
}

// The point's table on stdout and one JSON row per variant, with the run's provenance.
void print_table(const Options& o, PointSamples& ps, const PointBatch& pb, const nlohmann::json& provenance,
                 nlohmann::json& rows) {
  const std::string& name = ps.model;
  const auto& cfg = *ps.cfg;
  const int64_t T = ps.T, N = pb.N;
  const auto& ragged_rows = pb.ragged_rows;
  auto med = [&](const Kind& k, collider::stats::Series Measured::*f) { return ps.median(k, f); };
  auto peak = [&](const Kind& k) { return ps.samples[k.name].peak_bytes; };
  auto& samples = ps.samples;
  const double reg = med(kRegular, &Measured::bwd_ms), floor_ms = med(kFloor, &Measured::bwd_ms);
  std::printf("\n%s  T=%ld  T'=%ld  attention/linear FLOPs %.3f\n", name.c_str(), static_cast<long>(T),
              static_cast<long>(N), collider::models::attention_linear_ratio(cfg, T));
  if (!ragged_rows.empty()) {
    std::string c;
    int64_t total = 0;
    for (int64_t n : ragged_rows) c += (c.empty() ? "" : ", ") + std::to_string(n), total += n;
    std::printf(
        "  batch_topk on real excess losses keeps %ld tokens, per row [%s] (padded to %ld); per_sequence "
        "keeps %ld (%ld per row)\n",
        static_cast<long>(total), c.c_str(),
        static_cast<long>(*std::max_element(ragged_rows.begin(), ragged_rows.end())),
        static_cast<long>(N * o.batch), static_cast<long>(N));
  }
  std::printf("  %-24s %9s %10s %8s %9s %10s %8s %9s %10s\n", "method", "bwd_ms", "reduction", "ideal", "of ideal",
              "rewrite%", "rw/reg%", "vs floor", "peak_MiB");
  for (const Kind& k : ps.kinds) {
    const double b = med(k, &Measured::bwd_ms), rw = med(k, &Measured::rewrite_ms);
    const double red = 1 - (b + rw) / reg;  // the rewrite is part of collider's backward cost
    const double ideal = ideal_of(o, ps, pb, k);
    const bool collider_kind = k.is_collider();
    std::printf("  %-24s %9.2f %9.1f%% %7.1f%% %9s %9.2f%% %7.2f%% %8.2fx %10.1f\n", k.name, b, 100 * red,
                100 * ideal, collider_kind ? std::to_string(red / ideal).substr(0, 5).c_str() : "-", 100 * rw / b,
                100 * rw / reg, (b + rw) / floor_ms, peak(k) / 1048576.0);
    rows.push_back({{"model", name},
                    {"seq_len", T},
                    {"batch_size", o.batch},
                    {"filter_ratio", o.ratio},
                    {"kept", N},
                    {"method", k.name},
                    {"bwd_ms", b},
                    {"rewrite_ms", rw},
                    {"selection", collider::to_string(k.spec.policy)},
                    {"kept_per_row", k.ragged() ? ragged_rows : std::vector<int64_t>(o.batch, N)},
                    {"gather_ms", med(k, &Measured::gather_ms)},
                    {"gathered_bytes", samples[k.name].gathered_bytes},
                    {"tensors_gathered", samples[k.name].tensors_gathered},
                    {"reduction", red},
                    {"ideal", ideal},
                    {"floor_ms", floor_ms},
                    {"peak_mem_bytes", peak(k)},
                    {"attention_linear_ratio", collider::models::attention_linear_ratio(cfg, T)},
                    {"num_threads", torch::get_num_threads()},
                    {"torch_version", TORCH_VERSION},
                    {"device", o.device},
                    {"dtype", o.bf16 ? "bf16" : "fp32"},
                    {"cpu_allocator", collider::memory::cpu_allocator_mode()},
                    {"samples_bwd_ms", samples[k.name].bwd_ms.samples()},
                    {"samples_rewrite_ms", samples[k.name].rewrite_ms.samples()}});
    // The run's provenance as the sweeps record it (harness/run/results.h: git state, torch
    // and CUDA versions, device name, hostname); num_threads and torch_version as above.
    for (auto& [key, value] : provenance.items()) rows.back().emplace(key, value);
  }
}

// With --selection batch_topk: each ragged variant against per-sequence at the same total kept
// count, round by round (the two ran in the same round, minutes apart at most): median and range
// of the per-round ratios of backward + rewrite, and of the ragged reductions over their own
// FLOP ideal.
void print_ragged(const Options& o, PointSamples& ps, const PointBatch& pb, nlohmann::json& rows) {
  const std::string& name = ps.model;
  const int64_t T = ps.T;
  auto& samples = ps.samples;
  for (const auto& [ragged, same] : {std::pair{kRaggedKeptOnly, kKeptOnly}, std::pair{kRaggedExactQuery, kExactQuery}}) {
    if (pb.ragged_rows.empty()) break;
    std::vector<double> ratio, of_ideal;
    const double ideal = ideal_of(o, ps, pb, ragged);
    const auto &a = samples[ragged.name], &b = samples[same.name], &r = samples[kRegular.name];
    for (size_t i = 0; i < a.bwd_ms.samples().size(); ++i) {
      const double a_ms = a.bwd_ms.samples()[i] + a.rewrite_ms.samples()[i];
      ratio.push_back(a_ms / (b.bwd_ms.samples()[i] + b.rewrite_ms.samples()[i]));
      of_ideal.push_back((1 - a_ms / r.bwd_ms.samples()[i]) / ideal);
    }
    const double q = collider::stats::median(ratio), f = collider::stats::median(of_ideal);
    std::printf("  %-24s / per-sequence: median %.3f (rounds %.3f..%.3f); of its FLOP ideal: median %.3f (%.3f..%.3f)\n",
                ragged.name, q, *std::min_element(ratio.begin(), ratio.end()),
                *std::max_element(ratio.begin(), ratio.end()), f,
                *std::min_element(of_ideal.begin(), of_ideal.end()),
                *std::max_element(of_ideal.begin(), of_ideal.end()));
    for (auto& row : rows) {
      if (row["model"] == name && row["seq_len"] == T && row["method"] == ragged.name) {
        row["ratio_to_per_sequence"] = q;
        row["of_ideal_per_round"] = f;
      }
    }
  }
}

// The rewrite's time, and the copies it decides: each saved tensor is cut when the backward first
// reads it (collider_core/src/saved_cut.h), so those copies are inside bwd_ms; what a plain copy
// of the same bytes costs here is their floor. Copies made inside the call (ragged attention
// rows) are timed apart.
void print_rewrites(PointSamples& ps, nlohmann::json& rows) {
  for (const Kind& k : ps.kinds) {
    if (!k.is_collider()) continue;
    const Measured& mk = ps.samples[k.name];
    const double rw = mk.rewrite_ms.median(), g = mk.gather_ms.median(), copy_ms = mk.copy_ms.median();
    std::printf(
        "  rewrite %-20s %6.2f ms (of which copies %5.2f ms); %ld saved tensors cut in the backward, %.1f MB; "
        "plain copy of those bytes %5.2f ms = %.2f%% of the backward\n",
        k.name, rw, g, static_cast<long>(mk.tensors_gathered), mk.gathered_bytes / 1e6, copy_ms,
        100 * copy_ms / mk.bwd_ms.median());
    for (auto& r : rows)
      if (r["model"] == ps.model && r["seq_len"] == ps.T && r["method"] == k.name) r["copy_floor_ms"] = copy_ms;
  }
}

}  // namespace

int main(int argc, char** argv) try {
  Options o = parse(argc, argv);
  torch::Device dev(o.device);
  if (dev.is_cuda() && !torch::cuda::is_available()) throw std::invalid_argument("--device cuda: no CUDA device");
  if (o.bf16 && !dev.is_cuda()) throw std::invalid_argument("--bf16 needs --device cuda (CPU runs are fp32)");
  if (dev.is_cpu()) collider::memory::install_cpu_memory_tracking();
  collider::memory::MemoryProbe mem(dev);
  const nlohmann::json provenance = collider::harness::to_json(collider::harness::collect_provenance(dev));
  nlohmann::json rows = nlohmann::json::array();
  std::printf(
      "Collider backward benchmark: filter_ratio %.2f, batch %ld, %d reps (+%d warm-up), %d threads, %s, "
      "CPU allocator %s\n",
      o.ratio, static_cast<long>(o.batch), o.reps, o.warmup, torch::get_num_threads(),
      dev.is_cuda() ? (o.bf16 ? "CUDA bf16" : "CUDA fp32") : "CPU scale (relative figures)",
      collider::memory::cpu_allocator_mode());
  for (const auto& name : o.models) {
    const auto& cfg = collider::models::preset(name);
    auto m = collider::models::build_model(cfg, collider::models::AttentionImpl::kEager, 0);
    m->to(dev);
    collider::Plan plan = collider::trace_plan([&](int64_t B, int64_t T) {
      auto ids = torch::randint(cfg.vocab_size, {B, T}).to(dev);
      torch::Tensor loss_BT;
      {
        collider::harness::AutocastScope autocast(o.bf16);
        loss_BT = collider::models::token_losses(m->forward(ids), torch::randint(cfg.vocab_size, {B, T}).to(dev));
      }
      return collider::models::masked_mean_loss(loss_BT, torch::ones({B, T}, ids.options().dtype(torch::kBool)));
    });
    for (int64_t T : o.seqs) {
      const PointBatch pb = point_batch(o, cfg, m, T, dev);
      PointSamples ps{name, &cfg, T, {kRegular, kLossOnly, kKeptOnly, kExactQuery, kFloor}, {}};
      if (pb.keep_ragged.defined()) ps.kinds.insert(ps.kinds.end(), {kRaggedKeptOnly, kRaggedExactQuery});
      // One warm-up of o.warmup steps per variant, then o.reps serpentine rounds (harness/measure/
      // rounds.h, as the timing sweeps run): a method's place in the round, right after a large
      // backward or not, evens out over the rounds.
      auto run_kind = [&](const Kind& k) {
        return k.floor ? run_once(m, plan, k, pb.idx_N, pb.labels_N, pb.keep_N, mem, o.bf16)
                       : run_once(m, plan, k, pb.idx, pb.labels, k.ragged() ? pb.keep_ragged : pb.keep, mem, o.bf16);
      };
      collider::stats::Interleaving how;
      how.warm_up = [&](size_t j) {
        for (int w = 0; w < o.warmup; ++w) run_kind(ps.kinds[j]);
      };
      how.measure = [&](size_t j, int64_t) {
        const Kind& k = ps.kinds[j];
        const Sample s = run_kind(k);
        ps.samples[k.name].add(s, k.is_collider() ? collider::harness::cold_copy_ms(s.gathered_bytes, dev) : 0.0);
      };
      collider::stats::interleave(ps.kinds.size(), o.reps, how);
      print_table(o, ps, pb, provenance, rows);
      print_ragged(o, ps, pb, rows);
      print_rewrites(ps, rows);
    }
  }
  if (!o.json.empty()) {
    std::ofstream f(o.json);
    for (const auto& r : rows) f << r.dump() << "\n";
    std::printf("\nrows: %s\n", o.json.c_str());
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bm_collider_backward: %s\n", e.what());
  return 2;
}
