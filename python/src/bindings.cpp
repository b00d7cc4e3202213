// collider._C: the pybind11 module over collider_core (DESIGN.md section 4b). Thin on purpose:
// argument checks with plain messages live in python/collider/__init__.py, this file only maps
// types and makes sure every C++ failure reaches Python as collider.Error (collider::Error keeps
// its message; c10::Error, std::invalid_argument and any other std::exception are translated, so
// no TORCH_CHECK or raw shape error leaves the package as something else). A Python exception
// raised inside the trace callable comes back unchanged (pybind11::error_already_set).
// Built by python/CMakeLists.txt (in the main CMake build, or by python/setup.py standalone) with
// the pybind11 that torch ships. Tested by python/tests/test_api.py. The mechanism and its API
// only: what the benchmarks measure with (allocator, provenance, rounds, FLOP model) is the
// measuring kit's module, collider._measure (measure_bindings.cpp).
#include <collider/collider.h>
#include <collider/custom_saved.h>
#include <collider/filter_stats_fields.h>
#include <collider/select.h>
#include <collider/torch_compat.h>

#include <torch/csrc/autograd/python_function.h>
#include <torch/extension.h>

#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <cstring>
#include <exception>
#include <typeinfo>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

namespace py = pybind11;

namespace {

// Runs `fn`, turning every C++ exception except a pending Python one into collider::Error, which
// the registered translator raises as collider.Error. `who` prefixes messages of exceptions that
// do not come from the public API's own checks (they would otherwise read as internal noise).
std::string prefixed(const char* who, const std::string& msg) {
  return msg.rfind(who, 0) == 0 ? msg : std::string(who) + ": " + msg;
}

template <typename Fn>
auto guarded(const char* who, Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const collider::Error&) { throw; } catch (const py::error_already_set&) {
    throw;  // a Python exception from the user's callable: keep it as it is
  } catch (const py::builtin_exception&) { throw; } catch (const c10::Error& e) {
    throw collider::Error(prefixed(who, e.what_without_backtrace()));
  } catch (const std::invalid_argument& e) {
    throw collider::Error(prefixed(who, e.what()));
  } catch (const std::exception& e) {
    throw collider::Error(std::string(who) +
                          ": unexpected error inside collider (please report it with the model "
                          "that caused it): " +
                          e.what());
  }
}

collider::FilterOptions options_for(const std::string& attention) {
  collider::FilterOptions opts;
  try {
    opts.attention = collider::attention_grad_from_string(attention);
  } catch (const std::invalid_argument& e) { throw collider::Error(e.what()); }
  return opts;
}

}  // namespace

// The fused head's options as score_head and fused_head_loss take them from Python.
static collider::HeadOptions head_options(int64_t ignore_index, double softcap, double logit_scale, bool entropy,
                                   int64_t chunk_rows, int64_t chunk_vocab) {
  collider::HeadOptions opts;
  opts.ignore_index = ignore_index;
  opts.softcap = softcap;
  opts.logit_scale = logit_scale;
  opts.entropy = entropy;
  opts.chunk_rows = chunk_rows;
  opts.chunk_vocab = chunk_vocab;
  return opts;
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "Collider's C++ core (collider_core); use the wrappers in the collider package.";

  // collider.Error: every refusal of the library. A RuntimeError, so code that catches those keeps working.
  // Module-local, so it is tried before torch's global translators.
  auto error = py::register_local_exception<collider::Error>(m, "Error", PyExc_RuntimeError);
  // collider.UntraceableRoutes, a collider.Error: trace_plan could not trace a mixture-of-experts
  // model's routes (collider/error.h). Registered after Error, so it is tried first.
  py::register_local_exception<collider::UntraceableRoutes>(m, "UntraceableRoutes", error);
  // collider.GradientMismatch, a collider.Error: a step the check against mask_backward refused.
  py::register_local_exception<collider::GradientMismatch>(m, "GradientMismatch", error);
  m.attr("DEFAULT_CHECK_EVERY") = collider::kDefaultCheckEvery;

  // What ctx.save_for_backward kept in a Python custom Function's node, so that trace_plan can
  // refuse one that saves token-shaped tensors (collider/custom_saved.h).
  collider::detail::set_custom_saved_reader(
      [](torch::autograd::Node& node) -> std::vector<torch::autograd::SavedVariable>* {
        // By the type's (Itanium ABI) name: libtorch_python does not export PyNode's type info, which a
        // dynamic_cast or typeid(PyNode) would need.
        if (std::strcmp(typeid(node).name(), "N5torch8autograd6PyNodeE") != 0) return nullptr;
        auto& py_node = static_cast<torch::autograd::PyNode&>(node);
        if (!collider::python_object(py_node)) return nullptr;
        return &reinterpret_cast<THPFunction*>(collider::python_object(py_node))->saved_variables;
      });

  py::class_<collider::Plan>(m, "Plan")
      .def(py::init<>())
      .def("to_string", &collider::Plan::to_string, "The plan as text (Plan.from_string reads it back).")
      .def_static(
          "from_string",
          [](const std::string& text) {
            return guarded("Plan.from_string", [&] { return collider::Plan::from_string(text); });
          },
          py::arg("text"), "Reads a plan written by to_string(); raises collider.Error for text that is not one.")
      .def("summary", &collider::Plan::summary, "One line: nodes, token nodes, attention cores.")
      .def("merge", &collider::Plan::merge, py::arg("other"),
           "Adds the traced variants of another plan of the same model and loss (traced with an attention mask "
           "where this one had none, ...); filter_backward uses the variant whose graph matches.")
      .def_property_readonly("num_variants", &collider::Plan::num_variants,
                             "Traced variants held: 2 from trace_plan (B > 1 and B = 1), more after merge.")
      .def_property_readonly("num_nodes", &collider::Plan::num_nodes, "Autograd nodes of the traced loss graph.")
      .def_property_readonly("num_token_nodes", &collider::Plan::num_token_nodes,
                             "Nodes with at least one token dimension.")
      .def("__repr__", [](const collider::Plan& p) { return "<collider.Plan " + p.summary() + ">"; })
      .def(py::pickle([](const collider::Plan& p) { return p.to_string(); },
                      [](const std::string& text) {
                        return guarded("Plan (unpickle)", [&] { return collider::Plan::from_string(text); });
                      }));

  py::class_<collider::FilterStats> stats_class(m, "FilterStats");
  py::list stats_fields;  // collider.FilterStats' field names, for to_dict and repr (python/collider/__init__.py)
  collider::for_each_filter_stats_field([&](const char* name, auto member) {
    stats_class.def_readonly(name, member);
    stats_fields.append(name);
  });
  m.attr("filter_stats_fields") = stats_fields;

  // The callable is a Python function; pybind11's std::function wrapper takes the GIL around every
  // call (the caller holds it already) and turns a Python exception into error_already_set.
  m.def(
      "trace_plan",
      [](const std::function<torch::Tensor(int64_t, int64_t)>& fn, int64_t batch_a, int64_t seq_a, int64_t batch_b,
         int64_t seq_b) {
        collider::TraceOptions opts;
        opts.batch_a = batch_a;
        opts.seq_a = seq_a;
        opts.batch_b = batch_b;
        opts.seq_b = seq_b;
        return guarded("trace_plan", [&] { return collider::trace_plan(fn, opts); });
      },
      py::arg("loss_on_random_batch"), py::arg("batch_a"), py::arg("seq_a"), py::arg("batch_b"), py::arg("seq_b"));

  // The GIL is released while the graph is rewritten: the rewrite runs the autograd engine on the
  // loss's reduction (loss_checks.h), which refuses to start with the GIL held, and Python hooks it
  // meets take the GIL themselves.
  m.def(
      "filter_backward",
      [](const torch::Tensor& loss, const torch::Tensor& keep_mask, const collider::Plan& plan,
         const std::string& attention, bool validate, int64_t check_every) {
        auto opts = options_for(attention);
        opts.validate = validate;
        opts.check_every = check_every;
        py::gil_scoped_release no_gil;
        return guarded("filter_backward", [&] { return collider::filter_backward(loss, keep_mask, plan, opts); });
      },
      py::arg("loss"), py::arg("keep_mask"), py::arg("plan"), py::arg("attention"), py::arg("validate"),
      py::arg("check_every"));

  m.def(
      "mask_backward",
      [](const torch::Tensor& loss, const torch::Tensor& keep_mask, const collider::Plan& plan,
         const std::string& attention) {
        const auto opts = options_for(attention);
        py::gil_scoped_release no_gil;
        return guarded("mask_backward", [&] { return collider::mask_backward(loss, keep_mask, plan, opts); });
      },
      py::arg("loss"), py::arg("keep_mask"), py::arg("plan"), py::arg("attention"));

  m.def(
      "select_tokens",
      [](const torch::Tensor& scores, double filter_ratio, const std::string& policy, int64_t align,
         std::optional<torch::Tensor> valid) {
        return guarded("select_tokens", [&] {
          collider::SelectOptions opts;
          opts.policy = collider::select_policy_from_string(policy);
          opts.align = align;
          opts.valid_BT = std::move(valid);
          return collider::select_tokens(scores, filter_ratio, opts);
        });
      },
      py::arg("scores"), py::arg("filter_ratio"), py::arg("policy"), py::arg("align"), py::arg("valid"));

  // The fused LM head (collider/head.h): score_head scores every row, ScoredHead.loss(keep,
  // divisor) builds the filtered loss; collider.fused_head_loss is both (python/collider/__init__.py).
  py::class_<collider::ScoredHead>(m, "ScoredHead")
      .def_readonly("token_loss", &collider::ScoredHead::token_loss)
      .def_readonly("entropy", &collider::ScoredHead::entropy)
      .def(
          "loss",
          [](const collider::ScoredHead& self, std::optional<torch::Tensor> keep, double divisor) {
            py::gil_scoped_release no_gil;
            return guarded("ScoredHead.loss", [&] { return self.loss(keep.value_or(torch::Tensor()), divisor); });
          },
          py::arg("keep"), py::arg("divisor"));
  m.def(
      "fused_head_loss",
      [](const torch::Tensor& hidden, const torch::Tensor& weight, const torch::Tensor& targets,
         std::optional<torch::Tensor> keep, std::optional<torch::Tensor> bias, int64_t ignore_index, double softcap,
         double logit_scale, double divisor, bool entropy, int64_t chunk_rows, int64_t chunk_vocab, bool recompute) {
        collider::HeadOptions opts = head_options(ignore_index, softcap, logit_scale, entropy, chunk_rows, chunk_vocab);
        opts.divisor = divisor;
        opts.recompute = recompute;
        py::gil_scoped_release no_gil;
        return guarded("fused_head_loss", [&] {
          auto r = collider::fused_head_loss(hidden, weight, targets, keep.value_or(torch::Tensor()), opts,
                                             bias.value_or(torch::Tensor()));
          return std::make_tuple(r.loss, r.token_loss, r.entropy);
        });
      },
      py::arg("hidden"), py::arg("weight"), py::arg("targets"), py::arg("keep"), py::arg("bias"),
      py::arg("ignore_index"), py::arg("softcap"), py::arg("logit_scale"), py::arg("divisor"), py::arg("entropy"),
      py::arg("chunk_rows"), py::arg("chunk_vocab"), py::arg("recompute"));
  m.def(
      "fused_head_recomputes",
      [](int64_t rows, int64_t vocab, int64_t chunk_rows, int64_t chunk_vocab, bool recompute) {
        collider::HeadOptions opts;
        opts.chunk_rows = chunk_rows;
        opts.chunk_vocab = chunk_vocab;
        opts.recompute = recompute;
        return collider::fused_head_recomputes(rows, vocab, opts);
      },
      py::arg("rows"), py::arg("vocab"), py::arg("chunk_rows"), py::arg("chunk_vocab"), py::arg("recompute"));
  m.def(
      "score_head",
      [](const torch::Tensor& hidden, const torch::Tensor& weight, const torch::Tensor& targets,
         std::optional<torch::Tensor> bias, int64_t ignore_index, double softcap, double logit_scale, bool entropy,
         int64_t chunk_rows, int64_t chunk_vocab) {
        const auto opts = head_options(ignore_index, softcap, logit_scale, entropy, chunk_rows, chunk_vocab);
        py::gil_scoped_release no_gil;
        return guarded("score_head", [&] {
          return collider::score_head(hidden, weight, targets, opts, bias.value_or(torch::Tensor()));
        });
      },
      py::arg("hidden"), py::arg("weight"), py::arg("targets"), py::arg("bias"), py::arg("ignore_index"),
      py::arg("softcap"), py::arg("logit_scale"), py::arg("entropy"), py::arg("chunk_rows"), py::arg("chunk_vocab"));

  m.def(
      "kept_count",
      [](int64_t seq_len, double filter_ratio, int64_t align) {
        return guarded("kept_count", [&] { return collider::kept_count(seq_len, filter_ratio, align); });
      },
      py::arg("seq_len"), py::arg("filter_ratio"), py::arg("align"));

  m.def(
      "register_passthrough_node",
      [](const std::string& name) {
        guarded("register_passthrough_node", [&] { collider::register_passthrough_node(name); });
      },
      py::arg("name"));

  m.def("row_rules", [] {
    std::vector<std::tuple<std::string, std::string, std::string>> out;
    for (const auto& r : collider::row_rules()) out.emplace_back(r.node_type, r.rule, r.reason);
    return out;
  });

  // The torch this module was compiled against (its C++ ABI is tied to that exact version).
  m.attr("TORCH_VERSION_BUILT") =
      py::str(std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
              std::to_string(TORCH_VERSION_PATCH));
}
