// Non-ATen autograd nodes (see passthrough.h): the passthrough registry, a set of node names
// behind a mutex, the reader of Python custom Functions' saved tensors, and their row check.
#include "passthrough.h"

#include "node_fields.h"
#include "node_traits.h"
#include "token_index.h"

#include <collider/collider.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <atomic>
#include <mutex>
#include <set>

namespace collider {
namespace detail {

namespace {

std::mutex& passthrough_mutex() {
  static std::mutex m;
  return m;
}
std::set<std::string>& passthrough_nodes() {
  static std::set<std::string> s;
  return s;
}

std::atomic<CustomSavedReader>& reader() {
  static std::atomic<CustomSavedReader> r{nullptr};
  return r;
}

}  // namespace

bool is_passthrough(const std::string& name) {
  std::lock_guard<std::mutex> lock(passthrough_mutex());
  return passthrough_nodes().count(name) > 0;
}

void set_custom_saved_reader(CustomSavedReader r) { reader().store(r); }

std::vector<torch::autograd::SavedVariable>* custom_saved(torch::autograd::Node& node) {
  CustomSavedReader r = reader().load();
  return r ? r(node) : nullptr;
}

std::string row_mismatch(const NodePtr& node, const NodeSpec& spec,
                         const std::vector<torch::Tensor>& saved_tensors,
                         const std::vector<const FieldSpec*>& output_specs, int64_t B, int64_t T) {
  using torch::autograd::SavedVariable;
  auto* saved = custom_saved(*node);
  if (!saved) return "its saved tensors cannot be read";
  torch::NoGradGuard no_grad;
  // Every third position dropped, shifted per row: each row keeps and drops some.
  auto keep_BT = (torch::arange(T).unsqueeze(0) + torch::arange(B).unsqueeze(1)).remainder(3) != 1;
  TokenIndex ix(keep_BT);
  torch::manual_seed(0x5eed);
  torch::autograd::variable_list full_in, cut_in;
  for (uint32_t i = 0; i < node->num_inputs(); ++i) {
    const auto& meta = node->input_metadata(i);
    auto g = torch::randn(to_ints(meta.shape_as_dim_vector()), meta.options());
    const FieldSpec* f = spec.find(FieldKind::kInputMeta, static_cast<int32_t>(i));
    full_in.push_back(g);
    cut_in.push_back(f ? ix.cut(g, f->shape, true) : g);
  }
  // Each token-shaped saved tensor as the trace read it (behind checkpointing's hooks a second
  // unpack is refused), held as it is for the full run and cut for the second; the originals go back.
  auto first_line = [](const std::exception& e) {
    std::string w = e.what();
    w = w.substr(0, w.find('\n'));
    return w.size() > 80 ? w.substr(0, 77) + "..." : w;
  };
  std::vector<std::pair<size_t, SavedVariable>> originals;
  std::vector<std::pair<size_t, torch::Tensor>> full_saved, cut_saved;
  for (const auto& f : spec.fields) {
    if (f.kind != FieldKind::kSaved || f.item < 0) continue;
    const auto item = static_cast<size_t>(f.item);
    if (item >= saved->size() || item >= saved_tensors.size() || !saved_tensors[item].defined())
      return "its saved tensors cannot be read";
    full_saved.emplace_back(item, saved_tensors[item]);
    cut_saved.emplace_back(item, ix.cut(saved_tensors[item], f.shape, true));
  }
  for (const auto& [item, t] : full_saved) originals.emplace_back(item, std::move((*saved)[item]));
  auto hold = [&](const std::vector<std::pair<size_t, torch::Tensor>>& tensors) {
    for (const auto& [item, t] : tensors) (*saved)[item] = SavedVariable(t, false);
  };
  torch::autograd::variable_list full_out, cut_out;
  std::string error;
  try {
    hold(full_saved);
    full_out = (*node)(std::move(full_in));
    hold(cut_saved);
    cut_out = (*node)(std::move(cut_in));
  } catch (const std::exception& e) {
    error = first_line(e);
  }
  for (auto& [item, original] : originals) (*saved)[item] = std::move(original);
  if (!error.empty()) return "its backward fails on the traced batch (" + error + ")";
  if (cut_out.size() != full_out.size()) return "its backward returns a different number of gradients on cut rows";
  for (size_t j = 0; j < full_out.size(); ++j) {
    if (!full_out[j].defined() && !cut_out[j].defined()) continue;
    if (full_out[j].defined() != cut_out[j].defined()) return fmt::format("gradient {} is defined in one run only", j);
    const FieldSpec* f = j < output_specs.size() ? output_specs[j] : nullptr;
    if (!f) return fmt::format("gradient {} has no token dimension (a sum over rows, which cut rows would change)", j);
    auto want = ix.cut(full_out[j], f->shape, true);
    if (want.sizes() != cut_out[j].sizes()) {
      return fmt::format("gradient {} is [{}] on cut rows, not [{}]", j, fmt::join(cut_out[j].sizes(), ", "),
                         fmt::join(want.sizes(), ", "));
    }
    const auto dtype = want.scalar_type();
    const double eps = dtype == torch::kDouble ? 1e-12 : dtype == torch::kFloat ? 1e-5 : 1e-2;
    const double scale = want.numel() ? want.abs().max().item<double>() : 0.0;
    const double diff = want.numel() ? (want - cut_out[j]).abs().max().item<double>() : 0.0;
    if (diff > eps * std::max(scale, 1.0)) {
      return fmt::format("gradient {} on cut rows differs from the kept rows of the full backward (by {:.3g})", j,
                         diff);
    }
  }
  return {};
}

std::string reentrant_checkpoint_advice() {
  return "reentrant activation checkpointing (use_reentrant=True) recomputes its block inside the backward, "
         "where Collider cannot cut it. Use use_reentrant=False: torch.utils.checkpoint.checkpoint(fn, ..., "
         "use_reentrant=False), or in transformers gradient_checkpointing_enable(gradient_checkpointing_kwargs="
         "{\"use_reentrant\": False}) (its default)";
}

}  // namespace detail

void register_passthrough_node(const std::string& node_name) {
  // Nodes known to break the contract: registering them would turn a refusal into a crash in the
  // backward (or a wrong gradient).
  if (detail::traits_of(node_name).reentrant_checkpoint) {
    throw Error("register_passthrough_node: " + node_name + " is not a passthrough node: " +
                detail::reentrant_checkpoint_advice());
  }
  if (detail::traits_of(node_name).compiled_graph) {
    throw Error("register_passthrough_node: " + node_name +
                " is a torch.compile graph, not a passthrough node: its backward reads full-length saved "
                "activations. Build the filtered step without torch.compile");
  }
  std::lock_guard<std::mutex> lock(detail::passthrough_mutex());
  detail::passthrough_nodes().insert(node_name);
}

}  // namespace collider
