// Experiment manifests (TOML): what `collider run MANIFEST.toml` sweeps.
//
//   name = "smoke"                 # results go to results/<name>/<date-time>/ unless --out
//   description = "..."
//   [run]                          # every key optional; defaults in default_manifest_toml()
//   device = "auto"                # cpu | cuda | auto (cuda when available)
//   dtype = "auto"                 # fp32 | bf16 | auto (bf16 autocast on cuda, fp32 on cpu)
//   warmup_steps = 2; measure_steps = 5; repetitions = 1; seed = 0; threads = 0 (torch default)
//   lr, weight_decay, beta1, beta2, eps, grad_clip, align, selection, score, attention_impl, layer_timing
//   head = "dense"                 # dense (the model's own LM head) | fused (collider/head.h)
//   data = ""; reference_losses = ""   # real text scored by excess loss (score = "excess_loss")
//   aa_check = false               # measure each group's regular point twice (the A/A noise band)
//   floor = false                  # add each group's T' floor: regular on T' = kept_count(T, ratio,
//                                  # align) positions per row, measured in the group's rounds
//   copy_probe = false             # time a cold copy of the bytes each collider point's rewrite cut
//   [axes]                         # each a scalar or an array; cartesian product in this order
//   model = ["tinyllama-mini"]; seq_len = [512]; batch_size = [1]; filter_ratio = [0.0, 0.4]
//   method = ["regular", "loss_only", "collider", "masked"]; attention_grad = ["kept_only"]
//   selection = ["per_sequence", "batch_topk"]   # default: [run.selection]
//   [[exclude]]                    # drop the points that match every key given (arrays = any of)
//   method = "regular"; filter_ratio = 0.4
//
// attention_grad multiplies only collider and masked points; regular / loss_only points carry
// attention_grad = "none". selection multiplies only the methods that select (loss_only, collider,
// masked); a batch_topk point's id ends in /batch_topk. Precedence: built-in defaults, then the
// file, then --set key=value (each override echoed). Every problem (unknown key, wrong type, unknown model or method, ratio
// outside [0, 1), a ratio that keeps no token) is a ManifestError naming the file, the key, the
// value and what is allowed, raised before any compute. Loaded by the shared loader (loader.h);
// the training-manifest schema is train_manifest.h.
// Tests: tests/test_manifest.cpp.
#pragma once

#include "harness/config/loader.h"
#include "models/method.h"

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace collider::harness {

struct RunSettings {
  std::string device = "auto";  // resolved: "cpu" | "cuda"
  std::string dtype = "auto";   // resolved: "fp32" | "bf16"
  int64_t warmup_steps = 2;
  int64_t measure_steps = 5;
  // Interleaved rounds of measured steps: the points of one (model, seq_len, batch_size) group share
  // one model and one warm-up, then take turns, measure_steps each, `repetitions` times round-robin.
  int64_t repetitions = 1;
  int64_t seed = 0;
  int64_t threads = 0;  // torch intra-op threads; 0 = torch's default
  double lr = 3e-4, weight_decay = 0.1, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, grad_clip = 1.0;
  int64_t align = 8;
  // per_sequence | batch_topk (RHO-1: ragged rows; loss_only, collider, masked): the default of
  // axes.selection, which puts both in one group's rounds.
  std::string selection = "per_sequence";
  std::string score = "self";  // self | random | excess_loss (with data)
  // Real text instead of random tokens: every step runs on the first batch_size windows of
  // DATA/mix_train.bin (scripts/prepare_data.sh), scored by excess loss against their reference
  // model's per-token losses, REFERENCE_LOSSES (a *.reflosses.f32 of the utility experiment's
  // reference stage; seq_len a multiple of its window). Both empty: a random batch per step.
  std::string data, reference_losses;
  std::string attention_impl = "eager";  // eager | sdpa
  // The LM head: dense (the model's own: [B, T, V] logits, then the cross-entropy) | fused
  // (Collider's fused head, collider/head.h: every token scored, only the kept ones backpropagated).
  std::string head = "dense";
  bool layer_timing = true;              // per-layer marker timings in every row
  bool aa_check = false;                 // each group's regular point twice (its copy's id ends in /aa)
  // Each group's T' floors (DESIGN.md section 7): for every filter ratio of its collider and
  // forward_drop points, regular on T' = kept_count(T, ratio, align) positions per row, measured
  // in the group's rounds (id ends in /floor; the row's seq_len is T', floor_of is T).
  bool floor = false;
  // Each collider point's copy floor: per round, a plain cold copy of the bytes its rewrite cut
  // (harness/measure/probes.h), row key copy_floor_ms.
  bool copy_probe = false;
  std::string fail_point;  // tests: points whose point_id contains this fail
};

struct Point {
  std::string model;
  int64_t seq_len = 0;
  int64_t batch_size = 0;
  double filter_ratio = 0.0;
  std::string method;
  std::string attention_grad;  // "none" for regular / loss_only
  // The method, attention_grad, run.selection and run.score, parsed at load (the strings above are
  // the axis values as written: the point id, the row and [[exclude]] matching use them).
  models::MethodSpec spec;
  // The A/A copy of its group's regular point (run.aa_check): measured again in the same rounds.
  bool aa_copy = false;
  // A T' floor point (run.floor): regular at seq_len = T', measured in the group of seq_len
  // floor_of = T; 0 for every other point.
  int64_t floor_of = 0;
  // Stable id from the axis values, e.g. "tinyllama-debug/T64/B2/f0.4/collider/kept_only"
  // (".../f0.4/collider/kept_only/batch_topk" under batch_topk selection,
  // "tinyllama-debug/T64/B2/f0.4/regular/none/aa" for an A/A copy,
  // "tinyllama-debug/T32/B2/f0/regular/none/floor" for a floor point).
  std::string id() const;
  // Selects with batch_topk (a method that selects: loss_only, collider, masked).
  bool ragged() const;
  // The interleaved group it is measured in: "tinyllama-debug/T64/B2" (model, seq_len, batch_size;
  // a floor point's: floor_of).
  std::string group_id() const;
};

struct Manifest {
  std::string path;  // the file (or the name given to load_manifest_text)
  std::string name, description;
  RunSettings run;
  std::vector<Point> points;  // after exclusion, in sweep order: each group's points consecutive
  int64_t num_expanded = 0;   // before exclusion
  int64_t num_excluded = 0;
  int64_t num_aa_copies = 0;           // added by run.aa_check, one per group with a regular point
  int64_t num_floor_points = 0;        // added by run.floor
  std::vector<std::string> overrides;  // one echo line per --set
  std::vector<std::string> notes;      // warnings (an exclude that matches nothing)
  std::string resolved_toml;           // defaults + file + --set, as TOML
};

// The built-in defaults, as TOML (what a manifest overrides).
std::string default_manifest_toml();

// Loads, merges --set overrides ("key=value", key like run.measure_steps or axes.method; value in
// TOML syntax, or a bare word taken as a string), validates and expands. Throws ManifestError.
// check_device = false skips the "is CUDA available here" check (--dry-run lists a GPU manifest's
// points on any machine).
Manifest load_manifest(const std::string& path, const std::vector<std::string>& sets = {}, bool check_device = true);
Manifest load_manifest_text(const std::string& text, const std::string& source_name,
                            const std::vector<std::string>& sets = {}, bool check_device = true);

}  // namespace collider::harness
