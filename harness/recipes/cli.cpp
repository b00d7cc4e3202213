// `collider` subcommands (cli.h). `collider run`'s flags are a table (run_flags: each flag's name,
// how it takes its value, what it sets, its usage lines) read by one loop (parse_run_args), the way
// a manifest schema declares its keys (config/loader.h); run_run_command then reads as its steps.
#include "harness/recipes/cli.h"

#include "harness/components/distributed.h"
#include "base/fsutil.h"
#include "harness/config/manifest.h"
#include "harness/measure/table.h"
#include "harness/run/results.h"
#include "harness/run/run_dir.h"
#include "harness/recipes/score.h"
#include "harness/recipes/sweep.h"
#include "harness/recipes/train_run.h"
#include "models/flops.h"
#include "models/model.h"

#include <collider/select.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <iostream>
#include <map>

namespace collider::harness {
namespace {

// What `collider run` was given on its command line.
struct RunArgs {
  std::string manifest_path;
  std::vector<std::string> sets;  // each --set key=value, in order
  std::string out_dir;            // --out; empty: the default (results/<name>/<date-time>)
  std::string trace_path;         // --trace; empty: none
  bool dry_run = false, resume = false;
  int64_t profile_begin = -1, profile_end = -1;  // --profile-steps a:b; -1: none
};

// "a:b" with 0 <= a < b.
bool parse_steps(const std::string& s, int64_t* a, int64_t* b) {
  const auto c = s.find(':');
  if (c == std::string::npos) return false;
  try {
    size_t i = 0, j = 0;
    *a = std::stoll(s.substr(0, c), &i);
    *b = std::stoll(s.substr(c + 1), &j);
    return i == c && j == s.size() - c - 1 && *a >= 0 && *b > *a;
  } catch (const std::exception&) { return false; }
}

// One flag of `collider run`, declared as the manifest loader declares a key (config/loader.h):
// its name, how it takes its value, what it sets, and its lines in usage() (null: none; they print
// in table order). A value that does not parse is a std::invalid_argument, a usage error.
struct RunFlag {
  enum Value { kSwitch, kNext, kJoined };  // no value; the next argument; the rest of this one
  const char* name;
  Value value;
  void (*apply)(RunArgs& args, const std::string& value);
  const char* help;
};

const std::vector<RunFlag>& run_flags() {
  static const std::vector<RunFlag> flags = {
      {"--set", RunFlag::kNext, [](RunArgs& r, const std::string& v) { r.sets.push_back(v); },
       "--set run.measure_steps=10 / axes.method=[\"regular\",\"collider\"]  (TOML value or bare word)"},
      {"--set=", RunFlag::kJoined, [](RunArgs& r, const std::string& v) { r.sets.push_back(v); }, nullptr},
      {"--out", RunFlag::kNext, [](RunArgs& r, const std::string& v) { r.out_dir = v; }, nullptr},
      {"--dry-run", RunFlag::kSwitch, [](RunArgs& r, const std::string&) { r.dry_run = true; }, nullptr},
      {"--resume", RunFlag::kSwitch, [](RunArgs& r, const std::string&) { r.resume = true; },
       "--resume     skip the points already ok in DIR/results.jsonl (without --out: the newest\n"
       "                   directory under results/<name>/)"},
      {"--trace", RunFlag::kNext, [](RunArgs& r, const std::string& v) { r.trace_path = v; },
       "--trace FILE Chrome/Perfetto trace JSON of every range (layer.07.bwd, filter, ...)"},
      {"--profile-steps", RunFlag::kNext,
       [](RunArgs& r, const std::string& v) {
         if (!parse_steps(v, &r.profile_begin, &r.profile_end))
           throw std::invalid_argument("--profile-steps '" + v + "' must be a:b with 0 <= a < b (steps [a, b))");
       },
       "--profile-steps a:b  cudaProfilerStart before step a and Stop after step b-1 of every\n"
       "                   point (steps counted from 0, warm-up included; nsys --capture-range=cudaProfilerApi)"},
  };
  return flags;
}

std::string run_flags_help() {
  std::string text;
  for (const auto& f : run_flags())
    if (f.help) text += std::string("      ") + f.help + "\n";
  return text;
}

// The flags (run_flags) and the one manifest path; a usage error is a std::invalid_argument.
RunArgs parse_run_args(const std::vector<std::string>& args) {
  RunArgs r;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    const auto& flags = run_flags();
    const auto f = std::find_if(flags.begin(), flags.end(), [&](const RunFlag& flag) {
      return flag.value == RunFlag::kJoined ? a.rfind(flag.name, 0) == 0 : a == flag.name;
    });
    if (f != flags.end()) {
      std::string value;
      if (f->value == RunFlag::kNext) {
        if (i + 1 >= args.size()) throw std::invalid_argument(fmt::format("{} needs a value", f->name));
        value = args[++i];
      } else if (f->value == RunFlag::kJoined) {
        value = a.substr(std::string(f->name).size());
      }
      f->apply(r, value);
    } else if (!a.empty() && a[0] == '-') {
      throw std::invalid_argument("unknown option '" + a + "'");
    } else if (r.manifest_path.empty()) {
      r.manifest_path = a;
    } else {
      throw std::invalid_argument("more than one manifest given ('" + r.manifest_path + "' and '" + a + "')");
    }
  }
  if (r.manifest_path.empty()) throw std::invalid_argument("no manifest given");
  return r;
}

}  // namespace

std::string usage() {
  return "usage:\n"
         "  collider models [--json]\n"
         "      every model preset: parameters, analytic FLOPs per token (forward; backward dense and with\n"
         "      40% of tokens filtered) at T = 512 and 2048, attention-core / linear FLOP ratio\n"
         "  collider run MANIFEST.toml [--set key=value]... [--out DIR] [--dry-run] [--resume]\n"
         "                             [--trace FILE] [--profile-steps a:b]\n"
         "      sweep a manifest; rows go to DIR/results.jsonl (default DIR: results/<name>/<date-time>)\n" +
         run_flags_help() +
         "      data-parallel when RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (LOCAL_RANK) are set: one process\n"
         "      per rank, c10d Gloo (CPU) / NCCL (CUDA), batch_size rows per rank, rows written by rank 0;\n"
         "      COLLIDER_DIST_TIMEOUT_S bounds every collective (default 300). scripts/launch.sh N MANIFEST\n"
         "      A manifest with a [train] table trains instead (experiments/tab_utility.toml): one run per\n"
         "      method, periodic evaluation, checkpoints; --resume continues unfinished runs; data-parallel as\n"
         "      above (batch_size windows per rank; rank 0 evaluates and writes rows and checkpoints)\n"
         "  collider score --checkpoint DIR --tokens FILE [--out FILE]\n"
         "      per-token losses of a Hugging Face-layout checkpoint (RHO-1 reference scores)\n"
         "  collider figures RESULTS.jsonl...\n"
         "      (re)write each measured group's figures (reduction, step_reduction, of_ideal, vs_floor;\n"
         "      DESIGN.md section 6) into its rows, as the engine writes them when a group ends: for rows\n"
         "      written before it did; each file is replaced atomically, its other keys unchanged\n";
}

int run_figures_command(const std::vector<std::string>& paths, std::ostream& out) {
  if (paths.empty()) throw std::invalid_argument("no results file given (collider figures RESULTS.jsonl...)");
  for (const auto& path : paths) {
    if (!fsutil::exists(path)) throw std::invalid_argument("'" + path + "' does not exist");
    ExistingResults existing = read_results(path, /*repair=*/false);
    if (existing.torn_bytes > 0 || existing.bad_lines > 0)
      throw std::invalid_argument("'" + path + "' has an incomplete or unparseable line; repair it first (collider "
                                  "run --resume repairs a run's own results.jsonl)");
    // A group's rows, in file order; rows without a group (training rows) keep no figures.
    std::map<std::string, std::vector<size_t>> groups;
    for (size_t i = 0; i < existing.rows.size(); ++i) {
      const auto& row = existing.rows[i];
      if (row.contains("group") && row["group"].is_string() && row.contains("bwd_ms"))
        groups[row["group"].get<std::string>()].push_back(i);
    }
    for (const auto& [name, index] : groups) {
      std::vector<nlohmann::json> rows;
      for (size_t i : index) rows.push_back(existing.rows[i]);
      write_group_figures(rows);
      for (size_t k = 0; k < index.size(); ++k) existing.rows[index[k]] = std::move(rows[k]);
    }
    std::string text;
    for (const auto& row : existing.rows) text += row.dump() + "\n";
    fsutil::write_file_atomic(path, text);
    out << fmt::format("collider figures: {}: {} groups, {} rows\n", path, groups.size(), existing.rows.size());
  }
  return 0;
}

int run_models_command(const std::vector<std::string>& args, std::ostream& out) {
  bool json = false;
  for (const auto& a : args) {
    if (a == "--json") {
      json = true;
    } else {
      std::cerr << "collider models: unknown argument '" << a << "'\n" << usage();
      return 2;
    }
  }
  const double kRatio = 0.4;
  const std::vector<int64_t> kSeqLens = {512, 2048};
  nlohmann::json all = nlohmann::json::array();
  for (const auto& cfg : models::presets()) {
    nlohmann::json j = {{"name", cfg.name},
                        {"family", models::to_string(cfg.family)},
                        {"num_params", cfg.num_params()},
                        {"num_layers", cfg.num_layers},
                        {"hidden_size", cfg.hidden_size},
                        {"intermediate_size", cfg.intermediate_size},
                        {"num_heads", cfg.num_heads},
                        {"num_kv_heads", cfg.num_kv_heads},
                        {"head_dim", cfg.head_dim},
                        {"vocab_size", cfg.vocab_size},
                        {"tie_embeddings", cfg.tie_embeddings}};
    nlohmann::json per_t = nlohmann::json::array();
    for (int64_t T : kSeqLens) {
      const int64_t N = collider::kept_count(T, kRatio, 8);
      const double t = static_cast<double>(T);
      auto fwd = models::forward_flops(cfg, 1, T);
      auto dense = models::backward_flops(cfg, 1, T, T, models::MethodSpec{});  // regular
      auto kept = models::backward_flops(cfg, 1, T, N, {models::Method::kCollider, collider::AttentionGrad::kKeptOnly});
      auto exact =
          models::backward_flops(cfg, 1, T, N, {models::Method::kCollider, collider::AttentionGrad::kExactQuery});
      per_t.push_back({{"seq_len", T},
                       {"filter_ratio", kRatio},
                       {"kept", N},
                       {"fwd_flops_per_token", fwd.total() / t},
                       {"bwd_flops_per_token_dense", dense.total() / t},
                       {"bwd_flops_per_token_kept_only", kept.total() / t},
                       {"bwd_flops_per_token_exact_query", exact.total() / t},
                       {"attention_linear_ratio", models::attention_linear_ratio(cfg, T)}});
    }
    j["flops"] = per_t;
    all.push_back(j);
  }
  if (json) {
    out << all.dump(2) << "\n";
    return 0;
  }
  out << "FLOPs per token (models/flops.h; GEMMs only, 2*m*n*k each, per token of a B x T batch):\n"
         "  fwd  = 2*L*[D*H*E + 2*D*G*E + H*E*D + M*D*F]  +  4*L*H*E*T  +  2*D*V\n"
         "         (projections + MLP, M = 3 SwiGLU / 2 GELU;  eager attention's full T x T QK^T and PV;  LM head)\n"
         "  bwd dense (regular, loss_only, masked) = 2 x fwd at T\n"
         "  bwd collider kept_only   = (N/T) * 2 x (linear + LM head) + 2 x attention core at N   (N kept per row)\n"
         "  bwd collider exact_query = (N/T) * 2 x (linear + LM head) + 4 GEMMs of N x T attention core\n"
         "  N = kept count for filter_ratio 0.4 (drop count rounded up to a multiple of 8); attn/lin = forward\n"
         "  attention-core FLOPs over decoder linear FLOPs (DESIGN.md section 7).\n\n";
  out << fmt::format("{:<18} {:>14} {:>6} | {:>9} {:>9} {:>9} {:>9} {:>7} | {:>9} {:>9} {:>9} {:>9} {:>7}\n", "preset",
                     "params", "layers", "fwd@512", "bwd@512", "bwdC@512", "bwdX@512", "attn/lin", "fwd@2048",
                     "bwd@2048", "bwdC@2048", "bwdX@2048", "attn/lin");
  out << fmt::format("{:<18} {:>14} {:>6} | {:>47} | {:>47}\n", "", "", "",
                     "GFLOP/token: fwd, bwd dense, collider kept/exact", "same at T = 2048");
  for (const auto& j : all) {
    std::string line = fmt::format("{:<18} {:>14} {:>6} |", j["name"].get<std::string>(),
                                   j["num_params"].get<int64_t>(), j["num_layers"].get<int64_t>());
    for (const auto& f : j["flops"]) {
      line += fmt::format(
          " {:>9.4f} {:>9.4f} {:>9.4f} {:>9.4f} {:>7.3f} |", f["fwd_flops_per_token"].get<double>() / 1e9,
          f["bwd_flops_per_token_dense"].get<double>() / 1e9, f["bwd_flops_per_token_kept_only"].get<double>() / 1e9,
          f["bwd_flops_per_token_exact_query"].get<double>() / 1e9, f["attention_linear_ratio"].get<double>());
    }
    line.resize(line.size() - 2);  // drop the last " |"
    out << line << "\n";
  }
  return 0;
}

namespace {

// The launch variables (RANK, WORLD_SIZE, ...): one process per rank when WORLD_SIZE > 1.
struct Launch {
  DistEnv env;               // meaningful when `distributed`
  bool distributed = false;  // one rank: a plain single-process run
  std::string rank_tag;      // "rank R of W: " before a distributed run's messages
  // Rank 0 (or the one process) writes files and reports.
  bool writer() const { return !distributed || env.rank == 0; }
};

// Throws std::invalid_argument for malformed launch variables.
Launch read_launch() {
  Launch l;
  if (auto e = dist_env_from_environment()) {
    l.env = *e;
    l.distributed = l.env.world_size > 1;
  }
  if (l.distributed) l.rank_tag = fmt::format("rank {} of {}: ", l.env.rank, l.env.world_size);
  return l;
}

// Joins the other ranks; false, after saying why, when that fails (the command's status 3).
bool connect(const Launch& l, const torch::Device& device, std::shared_ptr<ProcessGroup>* pg, std::ostream& err) {
  try {
    *pg = init_process_group(l.env, device);
  } catch (const std::exception& e) {
    err << "collider run: " << l.rank_tag << "distributed set-up failed: " << e.what() << "\n";
    return false;
  }
  err << fmt::format("collider run: {}{} process group up ({}:{})\n", l.rank_tag, (*pg)->backend(), l.env.master_addr,
                     l.env.master_port);
  return true;
}

// A manifest with a [train] table runs training (the utility table; train_run.h), on CPU.
int run_training(const RunArgs& a, const Launch& l, std::ostream& out, std::ostream& err) {
  std::shared_ptr<ProcessGroup> pg;
  if (l.distributed && !a.dry_run && !connect(l, torch::Device(torch::kCPU), &pg, err)) return 3;
  return run_train_command(a.manifest_path, a.sets, a.out_dir, a.dry_run, a.resume, out, err, pg);
}

// --dry-run: the sweep's size and settings, then its points, one line each.
void print_points(const Manifest& m, std::ostream& out) {
  out << fmt::format(
      "{}: {} points ({} expanded, {} excluded{}{}); device {}, dtype {}; per group of "
      "points with the same model, seq_len and batch: {} warm-up steps each, then {} interleaved "
      "rounds of {} measured steps each\n",
      m.name, m.points.size(), m.num_expanded, m.num_excluded,
      m.num_aa_copies ? fmt::format(", {} A/A copies", m.num_aa_copies) : "",
      m.num_floor_points ? fmt::format(", {} T' floor points", m.num_floor_points) : "", m.run.device, m.run.dtype,
      m.run.warmup_steps, m.run.repetitions, m.run.measure_steps);
  for (size_t i = 0; i < m.points.size(); ++i) out << fmt::format("{:>4}  {}\n", i + 1, m.points[i].id());
}

// --out, or the default (results/<name>/<date-time>; with --resume the newest there): std::runtime_error when
// --resume finds none. Only rank 0 writes: its choice is the one that counts.
std::string output_dir(const RunArgs& a, const Launch& l, const std::string& name) {
  if (!a.out_dir.empty()) return a.out_dir;
  if (!l.writer()) return "(rank 0's output directory)";
  return default_run_dir(name, a.resume);
}

// The sweep (sweep.h) into `out_dir`, then rank 0's summary: status 0, 1 when a point failed, 3 when a
// data-parallel run failed.
int sweep_and_report(const Manifest& m, const RunArgs& a, const std::string& out_dir, const Launch& l,
                     std::ostream& err) {
  SweepOptions so;
  if (l.distributed && !connect(l, torch::Device(m.run.device == "cuda" ? torch::kCUDA : torch::kCPU), &so.dist, err))
    return 3;
  if (l.writer()) err << fmt::format("collider run: {} ({} points) -> {}\n", m.name, m.points.size(), out_dir);
  so.out_dir = out_dir;
  so.resume = a.resume;
  so.trace_path = a.trace_path;
  so.profile_begin = a.profile_begin;
  so.profile_end = a.profile_end;
  so.log = &err;
  SweepSummary s;
  try {
    s = run_sweep(m, so);
  } catch (...) { return run_failure_status(err, l.rank_tag, std::current_exception()); }
  if (!l.writer()) return s.failed > 0 ? 1 : 0;  // rank 0 reports the run
  err << fmt::format("collider run: {} points: {} ok, {} failed, {} already ok (resumed); rows in {}\n", s.points, s.ok,
                     s.failed, s.resumed, s.results_path);
  if (!a.trace_path.empty()) err << "collider run: trace written to " << a.trace_path << "\n";
  return s.failed > 0 ? 1 : 0;
}

}  // namespace

int run_run_command(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  RunArgs a;
  try {
    a = parse_run_args(args);
  } catch (const std::invalid_argument& e) {
    err << "collider run: " << e.what() << "\n" << usage();
    return 2;
  }
  Launch launch;
  try {
    launch = read_launch();
  } catch (const std::invalid_argument& e) {
    err << "collider run: error: " << e.what() << "\n";
    return 2;
  }
  if (is_training_manifest(a.manifest_path)) return run_training(a, launch, out, err);

  Manifest m;
  try {
    m = load_manifest(a.manifest_path, a.sets, /*check_device=*/!a.dry_run);
  } catch (const ManifestError& e) {
    err << "collider run: error: " << e.what() << "\n";
    return 2;
  }
  for (const auto& o : m.overrides) err << o << "\n";
  for (const auto& n : m.notes) err << "note: " << n << "\n";
  if (a.dry_run) {
    print_points(m, out);
    return 0;
  }
  std::string out_dir;
  try {
    out_dir = output_dir(a, launch, m.name);
  } catch (const std::runtime_error& e) {
    err << "collider run: " << e.what() << "\n";
    return 2;
  }
  return sweep_and_report(m, a, out_dir, launch, err);
}

int cli_main(const std::vector<std::string>& args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    std::cout << usage();
    return args.empty() ? 2 : 0;
  }
  const std::string cmd = args[0];
  const std::vector<std::string> rest(args.begin() + 1, args.end());
  try {
    if (cmd == "models") return run_models_command(rest, std::cout);
    if (cmd == "run") return run_run_command(rest, std::cout, std::cerr);
    if (cmd == "score") return run_score(args);
    if (cmd == "figures") return run_figures_command(rest, std::cout);
  } catch (const std::exception& e) {
    std::cerr << "collider " << cmd << ": error: " << e.what() << "\n";
    return 1;
  }
  std::cerr << "collider: unknown command '" << cmd << "'\n" << usage();
  return 2;
}

}  // namespace collider::harness
