// Non-ATen autograd nodes (see passthrough.h): the passthrough registry, a set of node names
// behind a mutex, and the reader of Python custom Functions' saved tensors.
#include "passthrough.h"

#include <collider/collider.h>

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

bool is_reentrant_checkpoint(const std::string& name) { return name == "CheckpointFunctionBackward"; }

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
  if (detail::is_reentrant_checkpoint(node_name)) {
    throw Error("register_passthrough_node: " + node_name + " is not a passthrough node: " +
                detail::reentrant_checkpoint_advice());
  }
  if (node_name.find("CompiledFunction") != std::string::npos) {
    throw Error("register_passthrough_node: " + node_name +
                " is a torch.compile graph, not a passthrough node: its backward reads full-length saved "
                "activations. Build the filtered step without torch.compile");
  }
  std::lock_guard<std::mutex> lock(detail::passthrough_mutex());
  detail::passthrough_nodes().insert(node_name);
}

}  // namespace collider
