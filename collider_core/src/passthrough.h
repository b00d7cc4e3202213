// Internal: what the core knows of autograd nodes that Functions.h does not declare (custom
// autograd Functions, torch.compile graphs, reentrant checkpointing). Two things:
//   - the registry of nodes declared passthrough (they map gradients row for row and save nothing
//     token-shaped), filled by collider::register_passthrough_node (collider.h);
//   - the saved tensors of a Python torch.autograd.Function node (what ctx.save_for_backward
//     kept): the core has no Python, so the Python module installs a reader
//     (python/src/bindings.cpp); without it they are unknown.
//   - the row check of a Python custom Function with token-shaped inputs or saved tensors
//     (BLOOM's GELU): trace_plan runs its backward on the traced batch twice, as traced and cut to a
//     keep mask, and takes it (its saved tensors cut like any op's) only where the two agree.
// trace_plan uses them to refuse a node whose backward would read full-length rows (the plan's
// passes, passes/), filter_backward checks a registered node again. Tests: tests/test_core_plan.cpp,
// python/tests/test_api.py, python/tests/test_checkpointing.py.
#pragma once

#include "plan_impl.h"

#include "collider/custom_saved.h"
#include "collider/torch_compat.h"
#include <torch/csrc/autograd/saved_variable.h>

#include <string>
#include <vector>

namespace collider::detail {

// Whether register_passthrough_node(name) was called. Thread-safe.
bool is_passthrough(const std::string& name);

// The reader a binding installed (collider/custom_saved.h: set_custom_saved_reader); nullptr when
// the node is not a Python custom Function or no reader is installed.
std::vector<torch::autograd::SavedVariable>* custom_saved(torch::autograd::Node& node);

// A Python custom Function's backward run on the traced batch (B, T) twice: as traced, and with its
// token-shaped saved tensors (spec's kSaved fields) and gradients cut to a fixed keep mask, the
// gradients it returns (shaped by output_specs, one per next edge, nullptr where the edge carries
// no token dimension) compared on the kept rows. Empty when they agree (the node maps rows one to
// one and may be cut like an ATen op), else what differs. The node is left as it was.
// saved_tensors: ctx.saved_tensors as the trace read them (observe.h; they are not unpacked again).
std::string row_mismatch(const NodePtr& node, const NodeSpec& spec,
                         const std::vector<torch::Tensor>& saved_tensors,
                         const std::vector<const FieldSpec*>& output_specs, int64_t B, int64_t T);

// The refusal for reentrant activation checkpointing's node (torch.utils.checkpoint with
// use_reentrant=True; NodeTraits::reentrant_checkpoint), which recomputes its block inside the
// backward, in a graph the plan never saw: what to use instead.
std::string reentrant_checkpoint_advice();

}  // namespace collider::detail
