// Internal: classifying the fields of a traced node from its two observations (observe.h): which
// dimensions are token, flattened-token or batch dimensions (ShapeSpec, plan_impl.h), the row
// order of flattened ones, broadcast layouts of batch-less token fields, and the checks that
// refuse token-mixing ops. Used by trace_plan (trace.cpp). Tests: tests/test_core_plan.cpp.
#pragma once

#include "graph.h"
#include "observe.h"
#include "plan_impl.h"

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace collider::detail {

// The (batch, sequence) sizes of one trace.
struct Sizes {
  int64_t B, T;
};

// The most fixed positions a kTokenPlus dimension (T + mult) may have after its T token positions.
inline constexpr int64_t kMaxTokenPlus = 16;

// Classifies one field from its two observations into `spec`. Returns false (and `why`) for
// dimensions that scale with B or T in a way the rewriter cannot cut; with allow_routed, such a
// dimension is taken as kRouted (a mixture-of-experts route, routes.h, which must then claim it).
bool classify(const Observed& a, const Observed& b, Sizes sa, Sizes sb, ShapeSpec& spec, std::string& why,
              bool allow_routed = false);

// The positions of s's token dimensions; its batch dimension (or null); whether it has a
// flattened token dimension.
std::vector<int32_t> token_dims(const ShapeSpec& s);
const DimSpec* batch_dim(const ShapeSpec& s);
bool has_flat(const ShapeSpec& s);

// Gives every flattened token dimension of the plan its row order (batch- or sequence-major),
// read from the reshapes around it; throws collider::Error where the graph does not show it.
void resolve_flat_order(const Graph& g, PlanData& plan, const std::vector<ObservedNode>& observed);

// A reference layout: rank, batch position and multiplier, token positions (padded coordinates).
struct RefLayout {
  int32_t rank = 0;
  int32_t batch_dim = -1;
  int64_t mult = 1;
  std::vector<int32_t> tokens;
};
// The layout of a field with a batch and a token dimension (or a broadcast one), else nullopt.
std::optional<RefLayout> layout_of(const ShapeSpec& s);
// Gives a batch-less token field a broadcast layout against `ref` (see ShapeSpec); false when
// its dimensions do not line up with ref's.
bool align_broadcast(ShapeSpec& s, const std::vector<int64_t>& values, const RefLayout& ref);

// For an op that indexes or mixes along `dim`: does `dim` address a token dimension of the
// field? Ops without a `dim` field (convolutions) count as mixing.
bool along_token_dim(const ObservedNode& node, const Observed& field, const ShapeSpec& spec);
// A concatenation along the token dimension onto empty tensors (a KV cache at its first step),
// which keeps every position where it was and so may be cut.
bool is_cat_onto_empty(const ObservedNode& a, const ObservedNode& b, Sizes sa, Sizes sb);

}  // namespace collider::detail
