// Internal: filter_backward's check that the loss gives the dropped positions no gradient.
// Collider discards dropped rows wherever they are, so a loss that still counts a dropped position
// (an unmasked loss, or a keep mask laid out on other positions than the loss's, e.g. the labels'
// instead of the hidden states') would filter silently to a wrong gradient. Two cheap readings
// of the loss cover the two loss forms in use (both run every step, one device sync together):
//   - a cross-entropy that reduces over positions (mean or sum, transformers' labels loss): its
//     targets at the dropped positions must be ignore_index;
//   - a per-position loss reduced by the user (masked mean): the gradient reaching the
//     per-position losses, a [B, T] tensor, is computed through the loss's own reduction and must
//     be zero at the dropped positions.
// Other losses are checked by filter_backward's validate option (a step against mask_backward).
// Tests: python/tests/test_messages.py, tests/test_core_plan.cpp.
#pragma once

#include "graph.h"
#include "plan_impl.h"
#include "token_index.h"

#include <torch/torch.h>

namespace collider::detail {

// Throws collider::Error (prefixed with `who`) naming the first dropped position the loss counts.
void check_loss_ignores_dropped(const torch::Tensor& loss, const Graph& g, const PlanData& plan,
                                const TokenIndex& ix, const char* who);

}  // namespace collider::detail
