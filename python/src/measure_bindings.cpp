// collider._measure: the measuring kit (measuring/) and the FLOP model (models/flops.h) for the
// Python benchmarks (python/bench/), so that they measure and count as the C++ harness does: the
// tracking and caching CPU allocator and its peak (measuring/memory.h), the rows' provenance
// (measuring/provenance.h), the engine's interleaved rounds and order statistics
// (measuring/rounds.h, measuring/stats.h), a group's figures against its references
// (measuring/figures.h) and the FLOP formulas. A module of its own beside
// collider._C, which is the mechanism and its API only. Errors in its arguments raise ValueError.
// Built by python/CMakeLists.txt; tested by python/tests/test_bench_hf_backward.py.
#include <collider/collider.h>

#include "measuring/figures.h"
#include "measuring/memory.h"
#include "measuring/provenance.h"
#include "measuring/rounds.h"
#include "measuring/stats.h"
#include "models/flops.h"

#include <torch/extension.h>

#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <cmath>
#include <exception>
#include <string>
#include <type_traits>
#include <vector>

namespace py = pybind11;

namespace {

// Runs `fn`; a C++ exception leaves as ValueError with its message.
template <typename Fn>
auto as_value_error(const char* who, Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const py::error_already_set&) { throw; } catch (const c10::Error& e) {
    throw py::value_error(std::string(who) + ": " + e.what_without_backtrace());
  } catch (const std::exception& e) { throw py::value_error(std::string(who) + ": " + e.what()); }
}

}  // namespace

PYBIND11_MODULE(_measure, m) {
  m.doc() = "Collider's measuring kit (allocator, provenance, rounds, order statistics, FLOP model) for benchmarks.";

  // The C++ harness's CPU allocator (caches freed blocks >= 64 KiB as CUDA's caching allocator
  // does; COLLIDER_CPU_CACHING=0 turns caching off). Returns its mode.
  m.def("install_caching_cpu_allocator", [] {
    collider::memory::install_cpu_memory_tracking();
    return std::string(collider::memory::cpu_allocator_mode());
  });
  // Its live-tensor peak, as the C++ rows' peak_mem_bytes: reset, then read after a step.
  m.def("cpu_memory_reset_peak", [] { collider::memory::MemoryProbe(torch::kCPU).reset_peak(); });
  m.def("cpu_memory_peak_bytes", [] { return collider::memory::MemoryProbe(torch::kCPU).peak_bytes(); });

  // What the numbers ran on, collected as the C++ rows collect it, under the rows' keys
  // (harness/run/results.cpp: to_json). source_dir: the checkout measured.
  m.def(
      "provenance",
      [](const std::string& device, const std::string& source_dir) {
        const collider::Provenance p =
            as_value_error("provenance", [&] { return collider::collect_provenance(torch::Device(device), source_dir); });
        py::dict d;
        collider::for_each_field(p, [&](const char* key, const auto& value) {
          if constexpr (std::is_same_v<std::decay_t<decltype(value)>, const std::string*>) {
            d[key] = value ? py::object(py::str(*value)) : py::object(py::none());
          } else {
            d[key] = value;
          }
        });
        return d;
      },
      py::arg("device"), py::arg("source_dir"));

  // The measurement engine's rounds: warm_up(j) for each variant in order, then `rounds` rounds of
  // measure(j, round) in serpentine order, as every C++ side-by-side run.
  m.def(
      "interleave",
      [](size_t n, int64_t rounds, const std::function<void(size_t)>& warm_up,
         const std::function<void(size_t, int64_t)>& measure) {
        collider::stats::Interleaving how;
        how.warm_up = warm_up;
        how.measure = measure;
        collider::stats::interleave(n, rounds, how);
      },
      py::arg("n"), py::arg("rounds"), py::arg("warm_up"), py::arg("measure"));
  // One timed quantity's samples with each round's median (measuring/rounds.h: Series).
  py::class_<collider::stats::Series>(m, "Series")
      .def(py::init<>())
      .def("add", &collider::stats::Series::add)
      .def("end_round", &collider::stats::Series::end_round)
      .def("median", &collider::stats::Series::median)
      .def("rel_iqr", &collider::stats::Series::rel_iqr)
      .def_property_readonly("samples", &collider::stats::Series::samples)
      .def_property_readonly("round_medians", &collider::stats::Series::round_medians);
  m.def("median", &collider::stats::median, py::arg("values"));

  // A group's figures (measuring/figures.h), as the engine writes them into its rows: rows are dicts
  // of role ("baseline", "copy", "floor" or "method"), cost_ms, and optionally step_ms, flop_ideal
  // and t_prime; the result, one dict per row of reduction, step_reduction, of_ideal and vs_floor
  // (None where a reference is missing).
  m.def(
      "group_figures",
      [](const std::vector<py::dict>& rows) {
        using Role = collider::stats::GroupRow::Role;
        std::vector<collider::stats::GroupRow> in;
        for (const auto& d : rows) {
          collider::stats::GroupRow r;
          const std::string role = d.contains("role") ? d["role"].cast<std::string>() : "";
          if (role == "baseline") r.role = Role::kBaseline;
          else if (role == "copy") r.role = Role::kCopy;
          else if (role == "floor") r.role = Role::kFloor;
          else if (role == "method") r.role = Role::kMethod;
          else throw py::value_error("group_figures: role '" + role + "'; allowed: baseline, copy, floor, method");
          auto number = [&](const char* key) {
            return d.contains(key) && !d[key].is_none() ? d[key].cast<double>() : NAN;
          };
          r.cost_ms = number("cost_ms");
          r.step_ms = number("step_ms");
          r.flop_ideal = number("flop_ideal");
          r.t_prime = d.contains("t_prime") && !d["t_prime"].is_none() ? d["t_prime"].cast<int64_t>() : -1;
          in.push_back(r);
        }
        auto value = [](double v) { return std::isnan(v) ? py::object(py::none()) : py::object(py::float_(v)); };
        py::list out;
        for (const auto& f : collider::stats::group_figures(in))
          out.append(py::dict(py::arg("reduction") = value(f.reduction), py::arg("step_reduction") = value(f.step_reduction),
                              py::arg("of_ideal") = value(f.of_ideal), py::arg("vs_floor") = value(f.vs_floor)));
        return out;
      },
      py::arg("rows"));

  // The FLOP model (models/flops.h) on a shape given as a dict of FlopShape's fields; `mode` is
  // dense (the regular backward), kept_only or exact_query (Collider's). Counts as dicts of
  // linear, attention and lm_head.
  auto shape_of = [](const py::dict& d) {
    collider::models::FlopShape s;
    auto get = [&](const char* key, int64_t& field, bool required) {
      if (d.contains(key))
        field = d[key].cast<int64_t>();
      else if (required)
        throw std::invalid_argument(std::string("FLOP shape: missing ") + key);
    };
    if (d.contains("name")) s.name = d["name"].cast<std::string>();
    get("vocab_size", s.vocab_size, true);
    get("hidden_size", s.hidden_size, true);
    get("intermediate_size", s.intermediate_size, true);
    get("num_layers", s.num_layers, true);
    get("num_heads", s.num_heads, true);
    get("num_kv_heads", s.num_kv_heads, true);
    get("head_dim", s.head_dim, true);
    get("mlp_matrices", s.mlp_matrices, false);
    get("num_experts", s.num_experts, false);
    get("experts_per_token", s.experts_per_token, false);
    return s;
  };
  auto spec_of = [](const std::string& mode) {
    collider::models::MethodSpec spec;
    if (mode == "dense") return spec;
    spec.method = collider::models::Method::kCollider;
    spec.attention_grad = collider::attention_grad_from_string(mode);
    return spec;
  };
  auto counts = [](const collider::models::FlopCount& f) {
    return py::dict(py::arg("linear") = f.linear, py::arg("attention") = f.attention, py::arg("lm_head") = f.lm_head);
  };
  m.def(
      "forward_flops",
      [=](const py::dict& shape, int64_t B, int64_t T) {
        return as_value_error("forward_flops",
                              [&] { return counts(collider::models::forward_flops(shape_of(shape), B, T)); });
      },
      py::arg("shape"), py::arg("batch"), py::arg("seq_len"));
  m.def(
      "backward_flops",
      [=](const py::dict& shape, int64_t T, const std::vector<int64_t>& kept_per_row, const std::string& mode) {
        return as_value_error("backward_flops", [&] {
          return counts(collider::models::backward_flops_rows(shape_of(shape), T, kept_per_row, spec_of(mode)));
        });
      },
      py::arg("shape"), py::arg("seq_len"), py::arg("kept_per_row"), py::arg("mode"));
}
