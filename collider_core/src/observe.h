// Internal: what one trace sees of one autograd node: every field the generated handlers expose
// (node_fields.h), recorded by a FieldVisitor, and the node's input metadata. trace_plan compares
// the observations of two traces (classify.h). Tests: tests/test_core_plan.cpp.
#pragma once

#include "plan_impl.h"

#include "collider/torch_compat.h"

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace collider::detail {

// One field as seen in one trace.
struct Observed {
  std::string name;
  FieldKind kind = FieldKind::kSaved;
  int32_t item = 0;
  std::vector<int64_t> values;  // tensor sizes, or the entries of a sizes field
  bool scalar = false;          // a single c10::SymInt field
  bool defined = true;
};

struct ObservedNode {
  std::string type;
  bool generated = false;
  std::string described;  // saved fields, for messages
  std::vector<Observed> fields;
  std::optional<int64_t> dim;  // an `int64_t dim` field, for token-mixing checks
  // A Python custom Function's saved tensors as read (ctx.saved_tensors, by item): behind
  // checkpointing's hooks they can be unpacked only once, and its row check runs them again.
  std::vector<torch::Tensor> custom_saved;
};

// Every field of `node` (saved tensors' sizes, size fields, scalars, input metadata), in the
// generated handler's order; throws collider::Error when a saved tensor cannot be read.
ObservedNode observe(const NodePtr& node);

}  // namespace collider::detail
